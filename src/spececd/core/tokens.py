"""Token sequences: where two of them part.

Both sides keep a token history and compare it with the one the other side, a cache or
a hint holds: how much of the cache still holds, how much of a hint lies on what was
generated. Pure NumPy; knows nothing of models or the network.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if list(a[:n]) != list(b[:n]):  # compared whole first: they mostly agree
        n = int(np.argmax(np.asarray(a[:n]) != np.asarray(b[:n])))
    return n

"""What a process of SpecECD's own loads with transformers, and what it leaves out.

:func:`skip_unused_imports` marks the process as SpecECD's own (the command line and the
bench's workers call it); :func:`lean_transformers`, run by :mod:`spececd.backends.hf`
before it imports transformers, then leaves out what none of SpecECD's code uses. A user's
process that uses the Python API is left as it is. Nothing here imports a model runtime.
"""

from __future__ import annotations

import importlib.metadata
import sys

_SKIP_UNUSED = False  # set by skip_unused_imports: this process is SpecECD's own


def skip_unused_imports() -> None:
    """Say that this process is SpecECD's own (the command line's, a bench worker's), so
    that transformers, when a model needs it (:func:`lean_transformers`, run as
    :mod:`spececd.backends.hf` loads), skips what none of its code uses."""
    global _SKIP_UNUSED
    _SKIP_UNUSED = True


def lean_transformers() -> None:
    """In a process of SpecECD's own, before transformers loads: transformers before 5.21
    imports scikit-learn, and with it SciPy and pandas, as its generation utilities load,
    for the confidence threshold of its own assisted generation (run only by the bench's
    assisted baseline, whose worker does not call :func:`skip_unused_imports`): 1.8 s of
    every command's start on a 2-core CPU. There it is told scikit-learn is absent, as 5.21
    and later import it only where used. Elsewhere (the Python API in a user's process), or
    where transformers' generation utilities were imported already, nothing changes."""
    if not _SKIP_UNUSED or "transformers.generation.candidate_generator" in sys.modules:
        return
    try:
        from packaging.version import Version

        if Version(importlib.metadata.version("transformers")) >= Version("5.21"):
            return
        import transformers.utils
    except Exception:  # no transformers, no packaging, a broken install: the import says
        return
    if hasattr(transformers.utils, "is_sklearn_available"):
        transformers.utils.is_sklearn_available = lambda: False

"""SpecECD's exception roots.

Every error SpecECD raises on purpose derives from :class:`SpecECDError`.

- :class:`InputError`: something the user gave is wrong (a model path, a sampling
  parameter, a prompt). The message says what was wrong and what to do; the CLI prints
  it as one line and exits with status 2.
- Wire errors live in :mod:`spececd.protocol.errors` and derive from
  :class:`SpecECDError` too.
"""

from __future__ import annotations


class SpecECDError(Exception):
    """Base of every error SpecECD raises deliberately."""


class InputError(SpecECDError, ValueError):
    """A user-supplied value is invalid; the message names it and says what to do."""

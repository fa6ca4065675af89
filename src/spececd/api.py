"""Deprecated: the Python API is :mod:`spececd.generator` (and, at the top,
``from spececd import Generator``).

This module only re-exports it, so that ``from spececd.api import Generator`` and the
other names it held keep working, and warns (``DeprecationWarning``) when it is imported;
new code imports from :mod:`spececd.generator`, or the text helpers from
:mod:`spececd.text`; nothing inside SpecECD imports it. (Not to be confused with
:mod:`spececd.openai_api`, the OpenAI-compatible HTTP API, or the ``spececd api`` command
that serves it.)
"""

from __future__ import annotations

import warnings

from spececd.generator import AsyncGenerator, Completion, Generator, StreamChunk
from spececd.text import IncrementalDecoder, StopStrings

__all__ = ["AsyncGenerator", "Completion", "Generator", "IncrementalDecoder", "StopStrings",
           "StreamChunk"]

warnings.warn("spececd.api is deprecated: import Generator and the rest from spececd.generator "
              "(or spececd), the text helpers from spececd.text", DeprecationWarning,
              stacklevel=2)

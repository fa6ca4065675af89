"""Text from token ids as they arrive: what a streamed completion shows.

:class:`IncrementalDecoder` turns a growing list of token ids into text deltas, right for
tokenizers whose tokens read differently at the start of a text and for byte-level tokens
that split a character. :class:`StopStrings` finds stop strings in text that arrives in
pieces, holding back what may begin one. Both take text or ids in and give text out; they
know nothing of models, sessions or the network (a tokenizer's ``decode`` is all they use).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spececd.backends.base import Tokenizer

__all__ = ["IncrementalDecoder", "StopStrings"]


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas. Decodes a short window that
    starts before the new ids, so tokenizers that render a token differently at the start
    of a text (SentencePiece's leading space) come out right, and holds text back while it
    ends in a partial UTF-8 character (byte-level BPE tokens can split one)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoding window
        self._read = 0  # ids before this are emitted

    def flush(self) -> str:
        """The text still held back (an unfinished character at the end), as it is."""
        before = self._tokenizer.decode(self._ids[self._prefix:self._read])
        text = self._tokenizer.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(before):] if len(text) > len(before) else ""

    def push(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        before = self._tokenizer.decode(self._ids[self._prefix:self._read])
        text = self._tokenizer.decode(self._ids[self._prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]


class StopStrings:
    """Finds the first of ``stops`` in text that arrives in pieces, across piece (and so
    token) boundaries; holds back the end of the text while it may begin a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [stop for stop in stops if stop]
        self._pending = ""
        self.found = False

    def push(self, text: str) -> str:
        """The text that is safe to emit now; after a stop string, nothing more."""
        if self.found:
            return ""
        self._pending += text
        hits = [i for i in (self._pending.find(stop) for stop in self.stops) if i >= 0]
        if hits:
            self.found = True
            out, self._pending = self._pending[:min(hits)], ""
            return out
        keep = max((n for stop in self.stops for n in range(1, len(stop))
                    if self._pending.endswith(stop[:n])), default=0)
        out = self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(out):]
        return out

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out

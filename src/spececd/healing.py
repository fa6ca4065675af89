"""Token healing: the prompt-boundary fix for text prompts (the guidance library's approach).

A tokenizer merges characters across the place where a user's prompt ends: the default
pair's tokenizer writes a newline and the indentation after it as one token, so a prompt
cut after ``"def main():\\n"`` ends in a lone newline token the model rarely saw followed by
code. :func:`heal` drops the prompt's last token and returns the token ids the first
generated token may take: those whose text starts with the dropped token's text (the
dropped token itself among them). Generation then continues from the shorter prompt with
that one position masked, so the model chooses how to spell the boundary
(``"\\n    "``), and the text shown after the prompt leaves out the dropped text
(:class:`HealedText`), so nothing is duplicated or lost.

What the output is: the target model's own, for the healed prompt (the prompt without its
last token) with the first generated position restricted to ``allowed``. The mask is a
sampling setting (:attr:`~spececd.core.params.SamplingParams.heal_ids`, applied by
:func:`~spececd.core.sampling.penalize`), so the verifier applies it at the position after
the prompt and a draft that ignores it is simply rejected there; cloud-only and speculative
generation heal the same way.

Healing is left out (the prompt runs as given) when it cannot change anything or cannot
be done: a prompt of one token, a last token that is a special token or whose text is
empty or a cut character, no other token that starts with its text, or more than
:data:`MAX_HEAL_IDS` that do (a lone space in a large vocabulary: the mask would not fit a
small frame).

This module knows tokenizers only (their ``decode``); no model, no network.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spececd.backends.base import Tokenizer

__all__ = ["MAX_HEAL_IDS", "HealedText", "Healing", "heal", "token_texts"]

# The most token ids a healing mask may name (each costs at most 2 bytes in the hello).
MAX_HEAL_IDS = 8192

_TEXTS: weakref.WeakKeyDictionary[object, tuple[str, ...]] = weakref.WeakKeyDictionary()
_TEXTS_LOCK = threading.Lock()


def token_texts(tokenizer: Tokenizer, vocab_size: int) -> tuple[str, ...]:
    """The text of each token id below ``vocab_size`` as it reads inside a text (a
    SentencePiece token keeps its leading space): decoded after an anchor token, the
    anchor's text removed. Computed once per tokenizer."""
    with _TEXTS_LOCK:
        cached = _TEXTS.get(tokenizer)
        if cached is not None and len(cached) == vocab_size:
            return cached
        anchor = tokenizer.encode("a", bos=False)[:1]
        before = len(tokenizer.decode(anchor))
        texts = tuple(tokenizer.decode([*anchor, token])[before:] for token in range(vocab_size))
        _TEXTS[tokenizer] = texts
        return texts


@dataclass(frozen=True)
class Healing:
    """A healed prompt: ``prompt_ids`` (the prompt without its last token), ``allowed``
    (sorted: the ids the first generated token may take), ``dropped`` (the last token's
    text, which the first generated token's text starts with) and ``last`` (its id)."""

    prompt_ids: tuple[int, ...]
    allowed: tuple[int, ...]
    dropped: str
    last: int


def heal(ids: Sequence[int], tokenizer: Tokenizer, vocab_size: int) -> Healing | None:
    """The healing of the prompt ``ids``, or None where it is left out (see the module
    docstring)."""
    if len(ids) < 2 or ids[-1] in tokenizer.eos_token_ids or not 0 <= ids[-1] < vocab_size:
        return None
    texts = token_texts(tokenizer, vocab_size)
    dropped = texts[ids[-1]]
    if not dropped or "\ufffd" in dropped:
        return None
    stops = set(tokenizer.eos_token_ids)
    allowed = tuple(t for t, text in enumerate(texts)
                    if text.startswith(dropped) and t not in stops)
    if allowed == (ids[-1],) or len(allowed) > MAX_HEAL_IDS:
        return None
    return Healing(tuple(ids[:-1]), allowed, dropped, ids[-1])


class HealedText:
    """The completion's text after the user's prompt: removes the dropped text from the
    front of the decoded text as it arrives (the first generated token's text starts with
    it). Text in, text out."""

    def __init__(self, dropped: str) -> None:
        self._left = dropped  # still to remove

    def push(self, text: str) -> str:
        if not self._left:
            return text
        n = min(len(self._left), len(text))
        if text[:n] != self._left[:n]:
            # A tokenizer that renders a token's leading space only inside a text
            # (SentencePiece) decodes the completion's first token without it.
            self._left = self._left.lstrip(" ")
            n = min(len(self._left), len(text))
        self._left = self._left[n:]
        return text[n:]

"""A transformers tokenizer behind SpecECD's ``Tokenizer`` interface. Imports no torch:
an edge that needs only a target's tokenizer (drafting across two tokenizers) loads it
with :func:`load_tokenizer`."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spececd.backends.base import no_tools_error, takes_tools
from spececd.errors import InputError


class HFTokenizer:
    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...]) -> None:
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return list(self._tok(text, add_special_tokens=bos)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def files(self) -> dict[str, bytes]:
        with tempfile.TemporaryDirectory() as folder:
            self._tok.save_pretrained(folder)
            return {path.name: path.read_bytes() for path in Path(folder).iterdir()
                    if path.is_file()}

    def vocab_tokens(self) -> list[str]:
        vocab = self._tok.get_vocab()
        by_id = [""] * (max(vocab.values()) + 1)
        for token, i in vocab.items():
            by_id[i] = token
        return by_id

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None) -> list[int] | None:
        if not getattr(self._tok, "chat_template", None):
            return None
        if tools and not takes_tools(self._tok.get_chat_template(tools=tools)):
            raise no_tools_error()
        ids = self._tok.apply_chat_template(messages, tools=tools or None,
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        return list(ids)


def load_tokenizer(model: str, eos: tuple[int, ...] = ()) -> tuple[HFTokenizer, int]:
    """The tokenizer of a transformers folder or hub id, and its number of token ids.
    ``eos``: the ids that end a generation, when the caller knows them (else read here)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as exc:
        raise InputError(f"could not load the tokenizer of {model!r}: not a local folder, "
                         f"and the hub id could not be loaded ({str(exc).splitlines()[0]})"
                         ) from None
    return HFTokenizer(tokenizer, eos or eos_token_ids(model, tokenizer)), len(tokenizer)


def eos_token_ids(model: str, tokenizer: Any, config: Any = None) -> tuple[int, ...]:
    """The ids that end a generation: the generation config's (Llama 3 instruct has two),
    else the tokenizer's end-of-sequence token."""
    from transformers import GenerationConfig

    if config is None:
        try:
            config = GenerationConfig.from_pretrained(model)
        except (OSError, ValueError):
            config = None
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)

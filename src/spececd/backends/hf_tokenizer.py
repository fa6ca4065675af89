"""A transformers tokenizer behind SpecECD's ``Tokenizer`` interface. Imports no torch:
an edge that needs only a target's tokenizer (drafting across two tokenizers) loads it
with :func:`load_tokenizer`.

:class:`JsonTokenizer` is the same interface over a ``tokenizer.json`` read by the
``tokenizers`` package alone, with no transformers: what an edge with no draft model (lookup
drafts) and no transformers speaks the target's ids with. Its chat template is rendered
with Jinja2, in a sandbox, as transformers renders it."""

from __future__ import annotations

import json
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
        return by_id(self._tok.get_vocab())

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


class JsonTokenizer:
    """A tokenizer from the files a server's bundle carries (:mod:`spececd.backends.bundle`),
    through the ``tokenizers`` package: ``tokenizer.json``, and ``tokenizer_config.json``
    (or ``chat_template.jinja``) for the chat template and its special tokens."""

    def __init__(self, files: dict[str, bytes], eos_token_ids: tuple[int, ...]) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        if "tokenizer.json" not in files:
            raise InputError("the target's tokenizer has no tokenizer.json, which an edge "
                             "without transformers needs: pip install transformers (no "
                             "torch needed)")
        self._files = dict(files)
        self._tok = RustTokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
        self.eos_token_ids = eos_token_ids
        config = json.loads(files.get("tokenizer_config.json", b"{}") or b"{}")
        template = config.get("chat_template")
        if "chat_template.jinja" in files:
            template = files["chat_template.jinja"].decode("utf-8")
        self._template: str | None = template if isinstance(template, str) else None
        self._specials = {name: _token_text(config.get(name))
                          for name in ("bos_token", "eos_token", "pad_token", "unk_token")}

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=bos).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def files(self) -> dict[str, bytes]:
        return dict(self._files)

    def vocab_tokens(self) -> list[str]:
        return by_id(self._tok.get_vocab(with_added_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None) -> list[int] | None:
        if self._template is None:
            return None
        if tools and not takes_tools(self._template):
            raise no_tools_error()
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise InputError("rendering the target's chat template needs jinja2 (pip install "
                             "jinja2) or transformers") from None

        def raise_exception(message: str) -> None:
            raise InputError(f"the model's chat template refused these messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(
            value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(self._template).render(
            messages=messages, tools=tools or None, add_generation_prompt=True,
            **self._specials)
        return self.encode(text, bos=False)  # the template writes its own start tokens


def by_id(vocab: dict[str, int]) -> list[str]:
    """Each id's token string, in id order ("" for an id the vocabulary skips)."""
    tokens = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    return tokens


def _token_text(value: object) -> str:
    """A special token as tokenizer_config.json spells it: a string, or an AddedToken's
    ``content``."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""

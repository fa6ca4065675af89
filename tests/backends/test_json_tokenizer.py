"""The tokenizer an edge without transformers speaks the target's ids with
(:class:`~spececd.backends.hf_tokenizer.JsonTokenizer`, from a server's bundle, through the
``tokenizers`` package alone) against transformers' own on the same files: the same
fingerprint, the same ids for the same text, the same text back, and the same chat
template rendering, tools included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from spececd.backends.base import tokenizer_fingerprint
from spececd.backends.hf_tokenizer import HFTokenizer, JsonTokenizer, load_tokenizer
from tests.builders import MODELS, llama_cpp_models, qwen25_tokenizer, requires_default_pair

TEXTS = ["def main():\n    return 0\n", "  x = {'a': 1}\t# ü ß 漢字 😀", "", "\n\n\n",
         "<|endoftext|>import os"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def same_behaviour(theirs: HFTokenizer, vocab: int) -> None:
    ours = JsonTokenizer(theirs.files(), theirs.eos_token_ids)
    assert tokenizer_fingerprint(ours, vocab) == tokenizer_fingerprint(theirs, vocab)
    for text in TEXTS:
        for bos in (True, False):
            assert ours.encode(text, bos) == theirs.encode(text, bos), (text, bos)
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids)
    for tools in (None, TOOLS):
        assert ours.apply_chat_template(MESSAGES[:2], tools) == \
            theirs.apply_chat_template(MESSAGES[:2], tools)
    assert ours.apply_chat_template(MESSAGES, TOOLS) == theirs.apply_chat_template(MESSAGES,
                                                                                   TOOLS)


@requires_default_pair
def test_the_default_targets_tokenizer_without_transformers() -> None:
    theirs, vocab = load_tokenizer(str(MODELS / "target"))
    same_behaviour(theirs, vocab)


def test_qwen25s_tokenizer_without_transformers(tmp_path: Path) -> None:
    tokenizer = qwen25_tokenizer(llama_cpp_models())
    tokenizer.save_pretrained(tmp_path)
    theirs, _ = load_tokenizer(str(tmp_path), (tokenizer.eos_token_id,))
    same_behaviour(theirs, len(tokenizer))

"""Greedy output under every constraint kind is identical to transformers' on the target
alone with xgrammar's own transformers logits processor, in process, whatever the
speculation: rounds in exact and match mode, token trees, stream drafting, cloud-only
generation, and a draft of another tokenizer, which drafts unconstrained. (Over every
transport: ``tests/e2e/test_transports.py``; on vLLM:
``tests/e2e/test_vllm.py``.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
xgr = pytest.importorskip("xgrammar")

from spececd.core.params import Constraint  # noqa: E402
from spececd.core.stats import GenerationStats  # noqa: E402
from spececd.generator import Generator  # noqa: E402
from tests.reference import PROMPTS, _reference_model  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "items": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "items", "n"], "additionalProperties": False}
CONSTRAINTS = {
    "json_schema": Constraint("json_schema", json.dumps(SCHEMA)),
    "json_object": Constraint("json_object"),
    "regex": Constraint("regex", r"[a-z]{2,8} = \d+;"),
    "choice": Constraint.of_choices(["alpha", "beta", "gamma delta"]),
    "grammar": Constraint("grammar", 'root ::= "(" item ("," item)* ")"\n'
                                     'item ::= [a-z]+ | [0-9]+'),
}
N = 24


def xgrammar_of(constraint: Constraint, compiler: Any) -> Any:
    """``constraint`` compiled by xgrammar itself, as SpecECD documents it: compact JSON
    (no free whitespace), json_object the schema of any object."""
    if constraint.kind == "json_schema":
        return compiler.compile_json_schema(constraint.spec, any_whitespace=False,
                                            strict_mode=constraint.strict)
    if constraint.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                            strict_mode=False)
    if constraint.kind == "regex":
        return compiler.compile_regex(constraint.spec)
    if constraint.kind == "choice":
        return compiler.compile_grammar("root ::= " + " | ".join(
            json.dumps(c) for c in constraint.choices()))
    return compiler.compile_grammar(constraint.spec)


def hf_constrained_greedy(model_dir: Path, ids: list[int], constraint: Constraint,
                          max_new_tokens: int, compile: Any = None) -> list[int]:
    """The reference: transformers' greedy generation with xgrammar's logits processor,
    stopping at the end-of-sequence token (kept, as SpecECD reports it); ``compile``:
    how the constraint is compiled (default :func:`xgrammar_of`)."""
    from transformers import AutoTokenizer

    written = max(f.stat().st_mtime_ns for f in Path(model_dir).iterdir())
    model = _reference_model(Path(model_dir), written)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size,
                                              stop_token_ids=[tokenizer.eos_token_id])
    grammar = (compile or xgrammar_of)(constraint, xgr.GrammarCompiler(info))
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         logits_processor=[xgr.contrib.hf.LogitsProcessor(grammar)],
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    return list(out[0, len(ids):].tolist())


@pytest.fixture(scope="module")
def gen(tiny_models: dict[str, Path]) -> Generator:
    return Generator.load(str(tiny_models["draft"]), str(tiny_models["llama"]), device="cpu",
                          dtype="float32", k=4, proactive="off")


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
@pytest.mark.parametrize("mode", ["exact", "match"])
def test_greedy_under_each_constraint_is_the_target_alone(
        kind: str, mode: str, gen: Generator, tiny_models: dict[str, Path]) -> None:
    constraint = CONSTRAINTS[kind]
    ids = gen.prompt_ids(PROMPTS[0])
    out = gen.generate(ids, max_tokens=N, temperature=0, constraint=constraint,
                       options=gen.options.with_settings(mode=mode))
    assert out.token_ids == hf_constrained_greedy(tiny_models["llama"], ids, constraint, N)


@pytest.mark.parametrize("settings,cloud_only", [
    ({"tree_width": 3, "mode": "exact"}, False),  # siblings are masked too
    ({"proactive": "stream"}, False),  # stream drafting's steps
    ({}, True),  # the server generates alone
])
def test_trees_streams_and_cloud_only_generation_are_masked_too(
        settings: dict[str, Any], cloud_only: bool, gen: Generator,
        tiny_models: dict[str, Path]) -> None:
    for kind in ("json_schema", "grammar"):
        constraint = CONSTRAINTS[kind]
        ids = gen.prompt_ids(PROMPTS[1])
        out = gen.generate(ids, max_tokens=N, temperature=0, constraint=constraint,
                           cloud_only=cloud_only, options=gen.options.with_settings(**settings))
        assert out.token_ids == hf_constrained_greedy(tiny_models["llama"], ids, constraint, N)


def forced_positions(model_dir: Path, tokens: list[int], constraint: Constraint) -> set[int]:
    """The positions of ``tokens`` where xgrammar's own matcher allows a single token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[tokenizer.eos_token_id])
    matcher = xgr.GrammarMatcher(xgrammar_of(constraint, xgr.GrammarCompiler(info)))
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    forced = set()
    for i, token in enumerate(tokens):
        matcher.fill_next_token_bitmask(bitmask)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
        if bits[:info.vocab_size].sum() == 1:  # one token allowed
            forced.add(i)
        assert matcher.accept_token(token)
    return forced


@pytest.mark.parametrize("settings", [{}, {"proactive": "stream"}, {"proactive": "on"}])
def test_forced_tokens_are_drafted_without_the_draft_model_and_shown_as_such(
        settings: dict[str, Any], tiny_models: dict[str, Path]) -> None:
    constraint = CONSTRAINTS["json_schema"]
    stats = GenerationStats()
    sources: list[str] = []
    tokens: list[int] = []
    # A generator of its own: stream drafting's gate starts open (no link measured yet).
    with Generator.load(str(tiny_models["draft"]), str(tiny_models["llama"]), device="cpu",
                        dtype="float32", k=4, **{"proactive": "off", **settings}) as gen:
        for chunk in gen.stream(gen.prompt_ids(PROMPTS[2]), stats, max_tokens=N,
                                temperature=0, constraint=constraint):
            sources += [chunk.source] * len(chunk.token_ids)
            tokens += chunk.token_ids
    # '{"name": "' is forced outright, and so are the keys and punctuation after it: the
    # output marks exactly the accepted drafts that were (xgrammar's matcher says which
    # positions allow one token; the verifier's own tokens there are the target's).
    marked = {i for i, source in enumerate(sources) if source == "forced"}
    assert stats.forced_tokens == len(marked)
    assert marked <= forced_positions(tiny_models["llama"], tokens, constraint)
    assert len(marked) >= 4
    if not settings:  # plain rounds: a drafted token took a draft model step or was forced
        assert stats.draft_steps + stats.forced_tokens <= stats.drafted


def test_a_draft_of_another_tokenizer_drafts_unconstrained_and_the_mask_keeps_it_valid(
        tiny_models: dict[str, Path], other_tokenizer_model: Path) -> None:
    with Generator.load(str(other_tokenizer_model), str(tiny_models["llama"]), device="cpu",
                        dtype="float32", k=4, proactive="off") as cross:
        assert cross.cross
        ids = cross.prompt_ids(PROMPTS[0])
        for kind in ("json_schema", "regex"):
            constraint = CONSTRAINTS[kind]
            out = cross.generate(ids, max_tokens=N, temperature=0, constraint=constraint)
            assert out.token_ids == hf_constrained_greedy(tiny_models["llama"], ids,
                                                          constraint, N)
            assert out.stats.forced_tokens == 0  # the draft's own tokens are not matched

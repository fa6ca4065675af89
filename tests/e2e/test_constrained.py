"""Constrained generation is lossless: sampled output under a constraint is distributed as
the target alone sampling under it, and every output is one the constraint allows.

The statistical tests run the real drafter (:class:`~spececd.edge.drafter.Drafter`,
masking its draft and proposing forced tokens) and the real verification pass
(:func:`~spececd.cloud.scheduler.run_verifications`, masking the target's rows with the
session's matcher) on the torch-free toy pair, without a transport (the end-to-end tests
in ``tests/e2e/test_constrained_models.py`` carry constraints over the wire), and compare
the outputs' distribution with the target's own, computed here from a trie of the
constraint's strings: no grammar engine in the reference. A planted bug, the mask on the
drafter only, must fail the same test.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest

from spececd.core.params import Constraint, Mode, SamplingParams
from spececd.core.sampling import process_logits
from spececd.edge.drafter import Drafter
from spececd.grammar import grammars_for
from tests.chisq import chi_square_p
from tests.rounds import generate
from tests.toy import EOS, ToyBackend, toy_pair

pytest.importorskip("xgrammar")

DRAWS = 3000
PROMPT = list(b"x = ")
CHOICES = ["aa", "ab", "ba", "bb", "abc", "c"]
REGEX = "(a|b){1,2}c?"  # the language, written out for the reference:
REGEX_STRINGS = [x + c for x in ("a", "b", "aa", "ab", "ba", "bb") for c in ("", "c")]
CASES = {"choice": (Constraint.of_choices(CHOICES), CHOICES),
         "regex": (Constraint("regex", REGEX), REGEX_STRINGS)}


def target_distribution(target: ToyBackend, prompt: Sequence[int], strings: Sequence[str],
                        params: SamplingParams) -> dict[bytes, float]:
    """P(the target alone, sampling under the constraint, writes each string and stops):
    at each prefix the target's distribution masked to the trie's next bytes (and the end
    where the prefix is a string of the language), renormalised by the processing."""
    language = {s.encode() for s in strings}

    def allowed(prefix: bytes) -> np.ndarray:
        mask = np.zeros(target.vocab_size, dtype=bool)
        for s in language:
            if s.startswith(prefix) and len(s) > len(prefix):
                mask[s[len(prefix)]] = True
        mask[EOS] = prefix in language
        return mask

    def probs(prefix: bytes) -> np.ndarray:
        ids = [*prompt, *prefix]
        logits = target.model.forward(ids)[-1:]
        masked = np.where(allowed(prefix)[None, :], logits, -np.inf)
        return process_logits(masked, params, ids, len(ids))[0]

    out = {}
    for s in language:
        p = 1.0
        for i in range(len(s)):
            p *= probs(s[:i])[s[i]]
        out[s] = p * probs(s)[EOS]
    assert sum(out.values()) == pytest.approx(1.0)
    return out


def sampled(drafter: Drafter, target: ToyBackend, constraint: Constraint, mode: Mode,
            mask_target: bool, params: SamplingParams, draws: int = DRAWS) -> Counter[bytes]:
    compiled = grammars_for(target.tokenizer, target.vocab_size).compile(constraint)
    matcher = compiled.matcher() if mask_target else None
    outputs: Counter[bytes] = Counter()
    for seed in range(draws):
        run = SamplingParams(temperature=params.temperature, top_k=params.top_k, seed=seed,
                             max_tokens=5, prompt_len=len(PROMPT), constraint=constraint)
        out = generate(drafter, target, matcher, PROMPT, run, mode, k=3)
        outputs[bytes(out[:-1]) if out and out[-1] == EOS else b"<unfinished>" + bytes(
            t % 256 for t in out)] += 1
    return outputs


def p_value(outputs: Counter[bytes], expected: dict[bytes, float]) -> float:
    cells = sorted(set(expected) | set(outputs))
    observed = np.array([outputs[c] for c in cells], dtype=float)
    probs = np.array([expected.get(c, 0.0) for c in cells])
    return chi_square_p(observed, probs * observed.sum())


@pytest.mark.parametrize("mode", [Mode.EXACT, Mode.MATCH])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_output_is_the_constrained_target_distribution(case: str, mode: Mode) -> None:
    draft, target = toy_pair(agreement=0.5)
    constraint, strings = CASES[case]
    params = SamplingParams(temperature=1.0, top_k=0)
    drafter = Drafter(draft)
    outputs = sampled(drafter, target, constraint, mode, True, params)
    assert set(outputs) <= {s.encode() for s in strings}  # every output is allowed
    p = p_value(outputs, target_distribution(target, PROMPT, strings, params))
    assert p > 0.001, (p, outputs)
    assert drafter.forced > 0  # "c" ends a choice, and "abc" follows "ab" alone


@pytest.mark.parametrize("mode", [Mode.EXACT, Mode.MATCH])
def test_a_mask_on_the_drafter_alone_is_caught(mode: Mode) -> None:
    """The planted bug: the verifier does not mask. Its corrections and bonus tokens then
    leave the language (and in exact mode, it accepts drafted tokens by unmasked odds).
    The same test at a tenth of the draws already fails it by far."""
    draft, target = toy_pair(agreement=0.5)
    constraint, strings = CASES["choice"]
    params = SamplingParams(temperature=1.0)
    outputs = sampled(Drafter(draft), target, constraint, mode, False, params, DRAWS // 10)
    assert p_value(outputs, target_distribution(target, PROMPT, strings, params)) < 1e-6


def test_every_sampled_completion_under_a_nested_schema_validates() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 4},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "at": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"}}, "required": ["x", "ok"],
            "additionalProperties": False}},
        "required": ["name", "tags", "at"], "additionalProperties": False}
    constraint = Constraint("json_schema", json.dumps(schema))
    draft, target = toy_pair(agreement=0.5)
    drafter = Drafter(draft)
    matcher = grammars_for(target.tokenizer, target.vocab_size).compile(constraint).matcher()
    valid = 0
    for seed in range(200):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=200,
                                prompt_len=len(PROMPT), constraint=constraint)
        out = generate(drafter, target, matcher, PROMPT, params, Mode.EXACT, k=4)
        assert out[-1] == EOS, bytes(out)
        # strict=False: xgrammar's JSON strings may hold raw control characters (< 0x20),
        # which strict JSON refuses (the README says so); the toy model writes many.
        jsonschema.validate(json.loads(bytes(out[:-1]).decode(), strict=False), schema)
        valid += 1
    assert valid == 200
    assert drafter.forced > 200  # the keys and punctuation the schema fixes


def test_the_drafter_says_which_tokens_of_an_output_it_forced() -> None:
    draft, _ = toy_pair(agreement=0.5)
    drafter = Drafter(draft)
    constraint = Constraint.of_choices(["abcd", "abxy"])
    params = SamplingParams(temperature=0, seed=0, prompt_len=len(PROMPT),
                            constraint=constraint)
    tokens, _ = drafter.draft(PROMPT, 4, Mode.MATCH, params, 0, 8)
    # "a" and "b" forced, the third the draft's choice (c or x), the fourth forced by it
    assert bytes(tokens[:2]) == b"ab" and drafter.forced_among(PROMPT, tokens) == (0, 1, 3)
    # An output that leaves the draft (the verifier chose the other): no mark from there
    other = ord("x") if tokens[2] == ord("c") else ord("c")
    assert drafter.forced_among(PROMPT, [*tokens[:2], other]) == (0, 1)
    assert drafter.forced_among(PROMPT[:-1], tokens) == ()  # another history: nothing known
    # Drafted again after that output: its marks are the new draft's; the old branch's,
    # past where the histories part, are gone.
    history = [*PROMPT, *tokens[:2], other]
    more, _ = drafter.draft(history, 2, Mode.MATCH, params, 0, 8)
    assert drafter.forced_among(history, more) == (0, 1)  # its last letter, then the end
    assert drafter.forced_among(PROMPT, tokens) == (0, 1)

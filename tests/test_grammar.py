"""Constraints: checked at entry, compiled (cached, time-limited, refused with a reason),
and the matcher's masks, rollback and forced tokens, on the toy byte tokenizer."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from spececd.core.params import Constraint, SamplingParams
from spececd.errors import InputError
from spececd.grammar import Grammars, InvalidConstraint, grammars_for, mask_logits
from tests.toy import EOS, VOCAB, ByteTokenizer

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return grammars_for(ByteTokenizer(), VOCAB)


def allowed_bytes(row: np.ndarray) -> set[int]:
    return {int(t) for t in np.flatnonzero(row)}


@pytest.mark.parametrize(("kind", "spec", "says"), [
    ("yaml", "x", "constraint kind must be one of"),
    ("json_object", "{}", "takes no spec"),
    ("regex", "", "needs a spec"),
    ("json_schema", "{not json", "the schema is not JSON"),
    ("json_schema", "[1]", "a schema is a JSON object"),
    ("choice", '["a", 1]', "non-empty JSON list of strings"),
    ("choice", "[]", "non-empty JSON list of strings"),
    ("grammar", "x" * 70_000, "over the limit"),
])
def test_a_malformed_constraint_is_refused_at_entry(kind: str, spec: str, says: str) -> None:
    with pytest.raises(InputError, match=says):
        Constraint(kind, spec)


def test_sampling_params_take_only_a_constraint() -> None:
    assert SamplingParams(constraint=Constraint("regex", "a+")).constraint == \
        Constraint("regex", "a+")
    with pytest.raises(InputError, match="must be a spececd Constraint"):
        SamplingParams(constraint="a+")  # type: ignore[arg-type]


@pytest.mark.parametrize(("constraint", "says"), [
    (Constraint("json_schema", '{"type": "foo"}'), 'invalid json_schema constraint: .*"foo"'),
    (Constraint("regex", "(ab"), "invalid regex constraint: .*parenthesis"),
    (Constraint("grammar", "root ::= foo"), 'invalid grammar constraint: .*"foo" is not defined'),
])
def test_what_does_not_compile_says_which_and_why(grammars: Grammars, constraint: Constraint,
                                                  says: str) -> None:
    with pytest.raises(InvalidConstraint, match=says):
        grammars.compile(constraint)
    assert grammars.cached(constraint)  # refused once, not compiled again


def test_compilations_are_cached_and_a_slow_one_is_refused(grammars: Grammars) -> None:
    schema = Constraint("json_schema", '{"type": "object", "properties": {"a": {}}}')
    assert grammars.compile(schema) is grammars.compile(schema)
    assert grammars.compile(Constraint(schema.kind, schema.spec, strict=False)) is not \
        grammars.compile(schema)
    big = json.dumps({"type": "object", "properties": {  # ~0.3 s to compile
        f"p{i}": {"type": "object", "properties": {
            f"q{j}": {"type": "string", "pattern": "[a-z]{3,9}"} for j in range(20)}}
        for i in range(40)}})
    slow = Constraint("json_schema", big)
    with pytest.raises(InvalidConstraint, match=r"took longer than 0\.001 s to compile"):
        grammars.compile(slow, timeout=0.001)
    # The refusal is not cached (the wait may have been a queue): the compile goes on, and
    # its result is cached when it comes.
    deadline = time.monotonic() + 60
    while not grammars.cached(slow) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert grammars.compile(slow, timeout=0.001).constraint == slow


def test_masks_follow_a_chain_and_a_tree_and_leave_the_matcher_in_place(
        grammars: Grammars) -> None:
    matcher = grammars.compile(Constraint.of_choices(["yes", "no", "maybe"])).matcher()
    rows = matcher.allowed(list(b"mxy"))  # x is refused: what follows it is never reached
    assert allowed_bytes(rows[0]) == set(b"nmy")
    assert allowed_bytes(rows[1]) == set(b"a")
    assert rows[2].all() and rows[3].all()
    assert matcher.tokens == []
    tree = matcher.allowed(list(b"nyo"), parents=[-1, -1, 0])  # n, y; n -> o
    assert allowed_bytes(tree[1]) == set(b"o") and allowed_bytes(tree[2]) == set(b"e")
    assert allowed_bytes(tree[3]) == {EOS}  # "no" is complete: end of sequence only
    assert matcher.tokens == []


def test_sync_rolls_back_and_termination_allows_only_the_end(grammars: Grammars) -> None:
    matcher = grammars.compile(Constraint.of_choices(["yes", "maybe"])).matcher()
    matcher.sync([*b"maybe", EOS, EOS])  # after the end: end-of-sequence again
    assert matcher.is_terminated() and allowed_bytes(matcher.allowed_now()) == {EOS}
    matcher.sync(list(b"ye"))
    assert allowed_bytes(matcher.allowed_now()) == set(b"s")
    with pytest.raises(InputError, match=r"token 2 .* not allowed by the choice constraint"):
        matcher.sync(list(b"yeX"))
    assert matcher.tokens == list(b"ye")


def test_forced_tokens_stop_at_a_choice_and_at_the_end(grammars: Grammars) -> None:
    matcher = grammars.compile(Constraint.of_choices(["yes", "maybe"])).matcher()
    assert matcher.forced(8) == []  # y or m
    matcher.sync(list(b"m"))
    assert matcher.forced(8) == [*b"aybe", EOS]
    assert matcher.forced(2) == list(b"ay")
    assert matcher.jump_forward() == "aybe"
    assert matcher.tokens == list(b"m")


def test_masked_logits_give_refused_tokens_no_probability() -> None:
    from spececd.core.sampling import process_logits

    logits = np.array([[3.0, 1.0, 2.0, 0.5]])
    allowed = np.array([[False, True, True, False]])
    params = SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.3)
    probs = process_logits(mask_logits(logits, allowed), params, [0, 3], 2)
    assert probs[0, 0] == 0 and probs[0, 3] == 0 and probs[0, 1:3].sum() == pytest.approx(1)
    greedy = SamplingParams(temperature=0.0)
    assert process_logits(mask_logits(logits, allowed), greedy)[0].argmax() == 2

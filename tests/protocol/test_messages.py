"""Encode/decode round trips and structural validation of wire messages. No sockets."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from spececd.core.logprobs import Logprobs
from spececd.core.params import Constraint, SamplingParams
from spececd.core.sampling import SparseProbs
from spececd.protocol import messages as m
from spececd.protocol.errors import MalformedFrame, VersionMismatch

FP = m.Fingerprint(512, "ab" * 32)


@pytest.mark.parametrize("message", [
    m.Hello(1, FP, "exact", 0.7, 5, 0.9, 123, "secret"),
    m.Hello(1, FP, "threshold", 0.7, 5, 0.9, 123, "", 0.25),
    m.Welcome("s1", 1, 16, 4096),
    m.Welcome("s1", 1, 16, 4096, lossy=True),
    m.Draft(3, 10, (1, 2, 3), (4, 5), None),
    m.Draft(1, 0, (), (), None),
    m.Verdict(3, 1, 77, 0.0125),
    m.Draft(9, 300, (4000, 4001, 300), (1000, 2000, 3000, 70000), None),
    m.Tokens(2, (500, 600), False, 0.002),
    m.Generate(4, 0, (1, 2, 3), 16, (0,)),
    m.Close("done"),
    m.Error("limit_exceeded", "too long", 4, False),
])
def test_round_trip(message: m.Message) -> None:
    assert m.decode(m.encode(message)) == message


def test_draft_probs_round_trip_exactly() -> None:
    dists = (SparseProbs(np.array([1, 7, 300]), np.array([0.5, 0.25, 0.25], np.float32)),
             SparseProbs(np.array([9]), np.array([1.0], np.float32)))
    decoded = m.decode(m.encode(m.Draft(1, 5, (), (7, 9), dists)))
    assert isinstance(decoded, m.Draft) and decoded.draft_probs is not None
    for a, b in zip(dists, decoded.draft_probs, strict=False):
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_array_equal(a.probs, b.probs)


def test_greedy_draft_is_a_few_bytes_per_token() -> None:
    frame = m.encode(m.Draft(1000, 300, (), (17, 4000, 99, 12), None))
    assert len(frame) <= 19


def test_greedy_draft_without_probs_and_hello_hash_round_trip() -> None:
    draft = m.Draft(3, 10, (), (5, 6))
    assert m.decode(m.encode(draft)) == draft
    hello = m.Hello(m.PROTOCOL_VERSION, m.Fingerprint(4096, "ab" * 32), "exact", 0.7, 0, 1.0, 5)
    frame = m.encode(hello)
    assert m.decode(frame) == hello and b"ab" * 32 not in frame  # 32 raw bytes, not hex
    tokens = m.Tokens(4, (1, 2, 3), False, 0.0123, 3, 2)
    decoded = m.decode(m.encode(tokens))
    assert isinstance(decoded, m.Tokens) and (decoded.drafted, decoded.accepted) == (3, 2)
    assert m.decode(m.encode(m.Hint(40, (7, 300)))) == m.Hint(40, (7, 300))
    assert decoded.compute_s == pytest.approx(0.0123, abs=m.TICK / 2)
    lone = m.Tokens(4, (1,), False, 0.0095)  # a step without a draft leaves out the counts
    assert m.decode(m.encode(lone)) == lone and len(m.encode(lone)) <= 10


def test_fields_added_later_are_left_off_and_older_frames_still_decode() -> None:
    hello = m.Hello(2, FP, "exact", 0.7, 0, 1.0, 5, "")
    welcome = m.Welcome("s1", 2, 16, 4096)
    assert len(msgpack.unpackb(m.encode(hello))) == 10  # no threshold field
    assert len(msgpack.unpackb(m.encode(welcome))) == 5  # no lossy field
    older = msgpack.packb([1, 2, 512, bytes.fromhex("ab" * 32), "match", 1, 0, 1, 5, ""])
    assert m.decode(older) == m.Hello(2, FP, "match", 1.0, 0, 1.0, 5, "", 0.0)
    assert m.decode(msgpack.packb([2, "s1", 2, 16, 4096])) == welcome


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"\x00", msgpack.packb([]), msgpack.packb({"a": 1}), msgpack.packb([99, 1]),
    msgpack.packb([3, 1, 0, [1]]),  # missing tokens field
    msgpack.packb([3, 1, 0, [1], [2], None, 1]),  # a field too many
    msgpack.packb([3, "1", 0, [1], [2], None]),  # seq as a string
    msgpack.packb([3, 1, 0, [1.5], [2], None]),  # a float token id
    msgpack.packb([3, 1, 0, [1], [2], [[2], b"\x00" * 4, b"\x00" * 4]]),  # sizes mismatch k
    msgpack.packb([3, 1, 0, [1], [2], [[1], b"\x00" * 3, b"\x00" * 4]]),  # short id bytes
    msgpack.packb([3, 1, 0, [1], [2], [[0], b"", b""]]),  # empty support
    msgpack.packb([1, True, 5, "h", "exact", 1.0, 0, 1.0, 1, ""]),  # bool as version
    msgpack.packb([4, 1, 0, 5]),  # verdict missing verify_s
    msgpack.packb([1, 2, 5, "h", "threshold", 1.0, 0, 1.0, 1, "", "0.5"]),  # threshold: a str
    msgpack.packb([2, "s", 2, 16, 4096, 1]),  # lossy as an integer
])
def test_malformed_frames_raise(frame: bytes) -> None:
    with pytest.raises(MalformedFrame):
        m.decode(frame)


# Frames as the protocol's first codec wrote them: one message type a frame, the optional
# fields each one may carry. Any change here is a change of the wire, and of its version.
LP = Logprobs(np.array([-0.5, -1.25], np.float32), np.array([[1, 2], [3, 4]], np.int64),
              np.array([[-0.1, -2.0], [-0.3, -4.0]], np.float32))
GOLDEN = [
    (m.Hello(3, m.Fingerprint(32000, "ab" * 16), "exact", 0.8, 5, 0.95, 3, "a", 0.0,
             m.SamplingExtras(1.1, 0.5, -0.25, 0.05, 12, ((3, 1.5), (9, -100.0)))),
     "9c0103cd7d00c410ababababababababababababababababa56578616374cb3fe999999999999a05cb3fee6"
     "6666666666603a1610097cb3ff199999999999acb3fe0000000000000cbbfd0000000000000cb3fa99999"
     "9999999a0c92030992cb3ff8000000000000d09c"),
    (m.Hello(6, m.Fingerprint(32000, "ab" * 16), "threshold", 0.5, 3, 0.5, 11, "t", 0.2,
             m.SamplingExtras(1.2, 0.1, 0.2, 0.3, 9, ((1, 2.0),)),
             Constraint("json_schema", '{"type": "object"}', False), m.LogprobsAsk(2, 1),
             (4, 5)),
     "9f0106cd7d00c410ababababababababababababababababa97468726573686f6c64cb3fe000000000000003"
     "cb3fe00000000000000ba174cb3fc999999999999a97cb3ff3333333333333cb3fb999999999999acb3fc9"
     "99999999999acb3fd3333333333333099101910293ab6a736f6e5f736368656d61b27b2274797065223a20"
     "226f626a656374227dc2930201ac7261775f6c6f6770726f6273920405"),
    (m.Welcome("sid", 6, 16, 4096, False, True), "9702a37369640610cd1000c2c3"),
    (m.Draft(4, 10, (), (1, 7), (
        SparseProbs(np.array([1, 5], np.int64), np.array([0.25, 0.75], np.float32)),
        SparseProbs(np.array([7], np.int64), np.array([1.0], np.float32)))),
     "9603040a9092010793920201c40c010000000500000007000000c40c0000803e0000403f0000803f"),
    (m.Verdict(3, 1, 9, 0.001, None, LP),
     "980403010904c09402c408000000bf0000a0bfc41001000000020000000300000004000000c410cdccccbd"
     "000000c09a9999be000080c0c0"),
    (m.Tokens(2, (5, 6), True, 0.01, 3, 1), "970802920506c3280301"),
    (m.Hint(5, (1, 2, 3), ((0, 9), (2, 11))), "94090593010203940009020b"),
]


@pytest.mark.parametrize("message,frame", GOLDEN, ids=[type(g[0]).__name__ for g in GOLDEN])
def test_the_wire_bytes_do_not_change(message: m.Message, frame: str) -> None:
    assert m.encode(message).hex() == frame
    assert m.encode(m.decode(bytes.fromhex(frame))) == bytes.fromhex(frame)


@pytest.mark.parametrize("params,version,prompt_len", [
    (SamplingParams(seed=1), 2, 0),
    (SamplingParams(seed=1, prompt_len=7), 2, 0),  # the prompt's length alone matters to none
    (SamplingParams(seed=1, repetition_penalty=1.2), 3, 0),
    (SamplingParams(seed=1, presence_penalty=0.5, prompt_len=7), 3, 7),  # counts the output
    (SamplingParams(seed=1, logprobs=2), 6, 0),
    (SamplingParams(seed=1, constraint=Constraint("regex", "a+"), prompt_len=3), 6, 3),
    (SamplingParams(seed=1, heal_ids=(4,), prompt_len=3), 6, 3),
])
def test_a_hello_maps_its_params_both_ways_in_the_lowest_version(
        params: SamplingParams, version: int, prompt_len: int) -> None:
    """Hello.from_params and Hello.params are each other's inverse but for what stays
    with the edge (max_tokens, stop tokens, a prompt length the server does not need);
    the version is the lowest that carries the settings, and the server's check agrees."""
    hello = m.Hello.from_params(params, FP, "exact")
    assert hello.protocol_version == version == hello.lowest_version()
    expected = dataclasses.replace(params, prompt_len=prompt_len)
    assert hello.params() == expected
    assert m.decode(m.encode(hello)).params() == expected  # type: ignore[union-attr]
    assert m.Hello.from_params(params, FP, "exact", trees=True).protocol_version == max(4, version)
    hello.check_version()
    if version > 2:
        with pytest.raises(VersionMismatch):
            dataclasses.replace(hello, protocol_version=version - 1).check_version()
    with pytest.raises(VersionMismatch):
        dataclasses.replace(hello, protocol_version=m.PROTOCOL_VERSION + 1).check_version()

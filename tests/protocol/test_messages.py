"""Encode/decode round trips and structural validation of wire messages. No sockets."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from spececd.core.sampling import SparseProbs
from spececd.protocol import messages as m
from spececd.protocol.errors import MalformedFrame

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

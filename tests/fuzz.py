"""Hostile input for the fuzz tests of every transport: a frame mutated at random, and
msgpack arrays that look like messages but are not."""

from __future__ import annotations

import random

import msgpack


def mutate(frame: bytes, rng: random.Random) -> bytes:
    """``frame`` with 1-4 random edits: a byte changed, a tail cut, bytes inserted or
    appended."""
    data = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.4 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice < 0.6 and data:
            del data[rng.randrange(len(data)):]
        elif choice < 0.8:
            data[rng.randrange(len(data) + 1):0] = bytes(rng.randrange(256)
                                                         for _ in range(rng.randint(1, 8)))
        else:
            data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
    return bytes(data)


def structured_junk(rng: random.Random) -> bytes:
    """A msgpack array with a message type (0 to 9: every type, and none) and fields of
    any type."""
    values: list[object] = [0, -1, 2**40, 1.5, float("nan"), "x", b"\x00" * 8, None, True,
                            [], [1, 2], {"a": 1}, [-5, 10**6]]
    return msgpack.packb([rng.randint(0, 9), *(rng.choice(values)
                                               for _ in range(rng.randint(0, 7)))])


def bad_frames() -> dict[str, list[bytes]]:
    """Frames over the limits ``Limits(max_draft=3, max_context=64, max_message_bytes=2000)``
    or otherwise wrong after a hello, by the error code each must get."""
    from spececd.protocol import messages as m

    return {
        "limit_exceeded": [m.encode(m.Draft(1, 0, (5,), (1, 2, 3, 4), None)),
                           m.encode(m.Draft(2, 0, tuple([5] * 70), (1,), None)),
                           b"\x00" * 3000],
        "invalid_tokens": [m.encode(m.Draft(3, 0, (5,), (100000,), None))],
        "malformed_frame": [b"\xc1\xc1"],
    }

"""The emitter: the one place that clips, counts and ends a generation."""

from __future__ import annotations

from spececd.core.params import SamplingParams
from spececd.core.stats import GenerationStats
from spececd.edge.emit import Emitter, Piece, RoundOutput


def emitter(max_tokens: int = 10, stops: tuple[int, ...] = (), max_context: int = 100
            ) -> Emitter:
    params = SamplingParams(seed=1, max_tokens=max_tokens, stop_token_ids=stops)
    return Emitter([1, 2, 3], params, GenerationStats(), max_context)


def test_stop_token_and_token_budget_clip_exactly() -> None:
    out = emitter(max_tokens=5, stops=(9,))
    assert out.emit(Piece((4, 5, 6), from_draft=2)) == RoundOutput((4, 5, 6), 2, False)
    assert (out.remaining, out.room) == (2, 94)
    assert out.emit(Piece((7, 8, 9, 10), from_draft=3)) == RoundOutput((7, 8), 2, True)
    stopped = emitter(stops=(9,))
    assert stopped.emit(Piece((4, 9, 5), from_draft=3)) == RoundOutput((4, 9), 2, True)
    assert stopped.stats.generated == 2


def test_context_limit_and_the_servers_done_end_generation() -> None:
    out = emitter(max_context=6)
    assert out.emit(Piece((4, 5))).finished is False
    assert out.emit(Piece((6,))).finished is True  # the context is full
    assert emitter().emit(Piece((4,), done=True)).finished is True


def test_fallback_output_is_marked_and_counted() -> None:
    out = emitter()
    out.emit(Piece((4,)))
    out.fall_back(max_context=50)
    emitted = out.emit(Piece((5,)))
    assert emitted.fallback and out.stats.fallback and out.stats.fallback_tokens == 1
    assert out.stats.generated == 2 and out.room == 45

"""What a generation emits, decided in one place.

The strategies (:mod:`spececd.edge.strategies`) bring tokens back from the verifier, or
from the draft model alone; the :class:`Emitter` owns what happens to them next. It holds
the authoritative token history, applies stop tokens and ``max_tokens`` exactly
(:func:`~spececd.core.stopping.clip_emitted`), ends the generation at the context limit
or when the server says it is done, counts what was emitted, records each verified round's
acceptance up to the end of the text (drafted tokens past a stop token are no part of the
output, so they count neither as drafted nor as accepted), and marks output that was never
verified, which accepted drafts a constraint forced and which were looked up (the draft
source knows: :meth:`~spececd.edge.drafter.DraftSource.forced_among`,
:meth:`~spececd.edge.drafter.DraftSource.looked_up_among`), and, of those, which a
prediction of the output proposed (:class:`~spececd.edge.sources.PredictedDraft`).
Log-probabilities, where asked,
follow their tokens through the same clipping; the prompt's are handed on once, the first
time a reply brings them. Strategies read the history and the budget from it and never
emit themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spececd.core.logprobs import Logprobs
from spececd.core.params import SamplingParams
from spececd.core.stats import GenerationStats
from spececd.core.stopping import clip_emitted


@dataclass(frozen=True)
class Piece:
    """Tokens one exchange brought, in order: the first ``from_draft`` were drafted and
    accepted, the rest came from the target; ``done``: the server ended the generation;
    ``drafted``: the drafted tokens the exchange verified, as a round (None: no round, e.g.
    a cloud-only step without hints)."""

    tokens: Sequence[int]
    from_draft: int = 0
    done: bool = False
    logprobs: Logprobs | None = None  # of ``tokens``, where asked
    prompt_logprobs: Logprobs | None = None  # of the request's context after its first token
    drafted: int | None = None


@dataclass(frozen=True)
class RoundOutput:
    """Tokens emitted: the first ``from_draft`` are accepted drafts, the rest came from
    the target; ``fallback`` output was never verified (the draft model's alone)."""

    token_ids: tuple[int, ...]
    from_draft: int
    finished: bool
    fallback: bool = False
    logprobs: Logprobs | None = None  # of ``token_ids``, where asked (never for fallback)
    # Of the prompt's tokens after the first (echo), on the first output that has them.
    prompt_logprobs: Logprobs | None = None
    # The indices of the accepted drafts that a constraint forced (no draft model step).
    forced: tuple[int, ...] = ()
    # The indices of the accepted drafts that were looked up (no draft model step).
    looked_up: tuple[int, ...] = ()
    # Of them, those a prediction of the output proposed (Predicted Outputs).
    predicted: tuple[int, ...] = ()


# The indices of ``tokens``, emitted after ``history``, that a constraint forced as drafted
# (or that were looked up).
ForcedAmong = Callable[[Sequence[int], Sequence[int]], tuple[int, ...]]


class Emitter:
    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams,
                 stats: GenerationStats, max_context: int,
                 forced_among: ForcedAmong | None = None,
                 looked_up_among: ForcedAmong | None = None,
                 predicted_among: ForcedAmong | None = None) -> None:
        self.history = list(prompt_ids)
        self.predicted_among = predicted_among
        self.forced_among = forced_among
        self.looked_up_among = looked_up_among
        self.prompt_len = len(self.history)
        self.prompt_logprobs_sent = False
        self.params, self.stats = params, stats
        self.max_context = max_context  # positions the history may fill
        self.generated = 0
        self.unverified = False
        self.verified_context = max_context  # the limit while verified

    @property
    def remaining(self) -> int:
        """Tokens still to generate before ``max_tokens``."""
        return self.params.max_tokens - self.generated

    @property
    def room(self) -> int:
        """Positions left in the context."""
        return self.max_context - len(self.history)

    def fall_back(self, max_context: int) -> None:
        """From now on the output is the draft model's alone, up to its own context."""
        if not self.unverified:
            self.verified_context = self.max_context
        self.unverified, self.stats.fallback = True, True
        self.max_context = max_context

    def verified_again(self) -> None:
        """The verifier answers again: from now on the output is verified."""
        self.unverified, self.max_context = False, self.verified_context

    def emit(self, piece: Piece) -> RoundOutput:
        """Take what one exchange brought (``piece``): clip it at stop tokens and
        ``max_tokens``, extend the history, count it in the statistics, and say what to show
        and whether the generation is finished."""
        out, finished = clip_emitted(piece.tokens, self.params.stop_token_ids, self.remaining)
        from_draft = min(piece.from_draft, len(out))
        forced = (self.forced_among(self.history, out[:from_draft])
                  if from_draft and self.forced_among is not None else ())
        self.stats.forced_tokens += len(forced)
        looked_up = (self.looked_up_among(self.history, out[:from_draft])
                     if from_draft and self.looked_up_among is not None else ())
        self.stats.lookup_accepted += len(looked_up)
        predicted = (self.predicted_among(self.history, out[:from_draft])
                     if looked_up and self.predicted_among is not None else ())
        self.history.extend(piece.tokens)
        self.generated += len(out)
        self.stats.generated += len(out)
        if piece.drafted is not None:
            # Where the text ended inside this round, only its drafted positions up to the
            # end count, and the verifier's own token only if it was emitted.
            ended = len(out) < len(piece.tokens)
            self.stats.record_round(min(piece.drafted, len(out)) if ended else piece.drafted,
                                    from_draft,
                                    own=len(out) > piece.from_draft)
        if self.unverified:
            self.stats.fallback_tokens += len(out)
        finished = finished or piece.done or len(self.history) >= self.max_context
        prompt = None
        if piece.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            # After a reconnect, the context the server scored may run past the prompt.
            prompt = piece.prompt_logprobs.rows(0, self.prompt_len - 1)
            self.prompt_logprobs_sent = True
        logprobs = piece.logprobs.rows(0, len(out)) if piece.logprobs is not None else None
        return RoundOutput(tuple(out), from_draft, finished, self.unverified, logprobs, prompt,
                           forced, looked_up, predicted)

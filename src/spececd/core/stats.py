"""Generation statistics with the definitions of ARCHITECTURE §2.

- acceptance rate = accepted / drafted over all rounds (a round's drafts all count, also
  the first position: it is never assumed accepted);
- mean accepted length = (accepted + rounds) / rounds, the tokens gained per target pass.

Counts are the verifier's raw verdicts, before stop tokens or ``max_tokens`` clip the
output; ``generated`` counts what was actually emitted.

``lossy`` marks statistics of a lossy verification mode (``threshold``): its output is not
the target's, so its acceptance is not comparable with a lossless run's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    generated: int = 0
    wall_s: float = 0.0
    draft_s: float = 0.0
    draft_steps: int = 0  # draft model steps run, drafted ahead and discarded ones included
    verify_s: float = 0.0  # as reported by the verifier
    network_s: float = 0.0  # round trips minus the verifier's reported time
    bytes_sent: int = 0
    bytes_received: int = 0
    reconnects: int = 0
    fallback: bool = False  # the verifier was unreachable and the draft finished alone
    fallback_tokens: int = 0
    lossy: bool = False  # verified in a lossy mode (threshold): not the target's output
    proactive_rounds: int = 0  # rounds run with proactive drafting on
    proactive_hits: int = 0  # of those, rounds whose block had been drafted ahead
    # accepted_by_position[i]: rounds whose drafted token i was accepted;
    # drafted_by_position[i]: rounds that drafted a token at position i.
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)

    def record_round(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        for counts, n in ((self.drafted_by_position, drafted),
                          (self.accepted_by_position, accepted)):
            counts.extend([0] * (drafted - len(counts)))  # both as long as the longest draft
            for i in range(n):
                counts[i] += 1

    def merge(self, other: GenerationStats) -> None:
        for name in ("drafted", "accepted", "rounds", "generated", "wall_s", "draft_s",
                     "draft_steps",
                     "verify_s", "network_s", "bytes_sent", "bytes_received", "reconnects",
                     "fallback_tokens", "proactive_rounds", "proactive_hits"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.fallback = self.fallback or other.fallback
        self.lossy = self.lossy or other.lossy
        for mine, theirs in ((self.drafted_by_position, other.drafted_by_position),
                             (self.accepted_by_position, other.accepted_by_position)):
            mine.extend([0] * (len(other.drafted_by_position) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_len(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "rounds": self.rounds,
            "generated": self.generated,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_len": round(self.mean_accepted_len, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "wall_s": round(self.wall_s, 4),
            "draft_s": round(self.draft_s, 4),
            "draft_steps": self.draft_steps,
            "verify_s": round(self.verify_s, 4),
            "network_s": round(self.network_s, 4),
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "bytes_per_token": round((self.bytes_sent + self.bytes_received)
                                     / max(1, self.generated), 2),
            "reconnects": self.reconnects,
            "fallback": self.fallback,
            "fallback_tokens": self.fallback_tokens,
            "lossy": self.lossy,
            "proactive_rounds": self.proactive_rounds,
            "proactive_hit_rate": round(self.proactive_hits / self.proactive_rounds, 4)
            if self.proactive_rounds else 0.0,
            "acceptance_by_position": [
                round(a / d, 4) if d else 0.0
                for a, d in zip(self.accepted_by_position, self.drafted_by_position, strict=True)
            ],
            "accepted_by_position": list(self.accepted_by_position),
            "drafted_by_position": list(self.drafted_by_position),
        }

"""The verifier's Prometheus metrics, one registry per server (no global state).

Names follow Prometheus conventions (``spececd_`` prefix, ``_total`` counters, base units):

- ``spececd_drafts_total``: drafts verified (= rounds);
- ``spececd_draft_tokens_total``, ``spececd_accepted_tokens_total``;
- ``spececd_accepted_tokens_by_position_total{position}`` and
  ``spececd_draft_tokens_by_position_total{position}``: acceptance per draft position;
- ``spececd_generated_tokens_total``: tokens the target produced itself (corrections,
  bonuses and cloud-only tokens), so that every token sent to an edge is counted once, in
  this or in ``spececd_accepted_tokens_total``;
- ``spececd_batch_size``: histogram of sessions per target forward pass;
- ``spececd_verify_latency_seconds``: histogram of verification passes;
- ``spececd_active_sessions``, ``spececd_kv_bytes``: gauges;
- ``spececd_errors_total{code}``: typed errors answered, by code;
- ``spececd_kv_evictions_total``: KV caches freed to stay under ``--max-kv-bytes``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.also: list[CollectorRegistry] = []  # served after ours (vLLM's own metrics)
        r = self.registry
        self.drafts = Counter("spececd_drafts", "Drafts verified (rounds)", registry=r)
        self.draft_tokens = Counter("spececd_draft_tokens", "Drafted tokens received",
                                    registry=r)
        self.accepted_tokens = Counter("spececd_accepted_tokens", "Drafted tokens accepted",
                                       registry=r)
        self.accepted_by_position = Counter(
            "spececd_accepted_tokens_by_position", "Accepted tokens by draft position",
            ["position"], registry=r)
        self.drafted_by_position = Counter(
            "spececd_draft_tokens_by_position", "Drafted tokens by draft position",
            ["position"], registry=r)
        self.generated_tokens = Counter("spececd_generated_tokens",
                                        "Tokens the target produced itself", registry=r)
        self.batch_size = Histogram("spececd_batch_size", "Sessions per target forward pass",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.verify_latency = Histogram("spececd_verify_latency_seconds",
                                        "Verification pass latency", buckets=LATENCY_BUCKETS,
                                        registry=r)
        self.active_sessions = Gauge("spececd_active_sessions", "Open sessions", registry=r)
        self.kv_bytes = Gauge("spececd_kv_bytes", "Bytes held in KV caches", registry=r)
        self.errors = Counter("spececd_errors", "Typed errors answered", ["code"], registry=r)
        self.kv_evictions = Counter("spececd_kv_evictions",
                                    "KV caches freed to stay under --max-kv-bytes", registry=r)

    def record_pass(self, drafted: int, accepted: int, generated: int, seconds: float,
                    is_round: bool) -> None:
        """One verification pass of a session: ``drafted`` tokens verified, ``accepted``
        of them kept, ``generated`` tokens of the target's own emitted (0 or 1). A round
        (an edge's draft, maybe empty) counts as a draft; a cloud-only step only when it
        verified a hint."""
        self.generated_tokens.inc(generated)
        self.verify_latency.observe(seconds)
        if not (is_round or drafted):
            return
        self.drafts.inc()
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        for i in range(drafted):
            self.drafted_by_position.labels(str(i)).inc()
            if i < accepted:
                self.accepted_by_position.labels(str(i)).inc()

    def exposition(self) -> bytes:
        return b"".join(generate_latest(r) for r in (self.registry, *self.also))

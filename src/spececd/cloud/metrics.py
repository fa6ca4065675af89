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
- ``spececd_verify_latency_seconds``: histogram of verification passes, as a session waits
  for its pass (the hand-off to the model's thread and back included);
- where the time of a batched pass goes, one observation per pass:
  ``spececd_pass_queue_seconds`` (each job's wait for its pass to start),
  ``spececd_pass_forward_seconds`` (the target's forward), ``spececd_pass_work_seconds``
  (the pass on the model's thread: the forward plus logits processing, verification,
  sampling and the caches' rollback) and ``spececd_pass_seconds`` (the pass as the event
  loop sees it: the work plus the hand-offs);
- the token budget (:mod:`spececd.core.budget`), one observation per pass of the built-in
  engine (on vLLM, whose steps are its own, its ``vllm:spec_decode_*`` metrics count the
  proposed and accepted tokens of each step):
  ``spececd_pass_prompt_tokens`` (context tokens prefilled: prompts, their chunks, resumes),
  ``spececd_pass_offered_positions`` (drafted positions the sessions sent),
  ``spececd_pass_verified_positions`` (of them, verified: the budget cuts the rest) and
  ``spececd_pass_accepted_tokens`` (of them, kept); ``spececd_goodput_tokens_per_second``
  (tokens the passes emitted, accepted drafts and the target's own, per second of pass
  work, over the last passes) and ``spececd_token_budget`` (positions a pass may compute
  now; 0: no budget);
- ``spececd_active_sessions``, ``spececd_kv_bytes``: gauges;
- ``spececd_errors_total{code}``: typed errors answered, by code;
- ``spececd_kv_evictions_total``: KV caches freed to stay under ``--max-kv-bytes``;
- ``spececd_abandoned_passes_total``: rounds dropped because their client left before
  their pass ran (a vanished client's queued prefill costs the others nothing);
- ``spececd_pass_cost_fit_error``: how far the token budget's fit of a pass's cost from its
  rows, positions and the cached tokens they read was off, ``|actual - predicted| /
  actual``, weighted toward recent passes (0 until it is fitted; the built-in runner).
- ``spececd_kv_pages_used``, ``spececd_kv_pages_free``: the built-in runner's KV page pool
  (:mod:`spececd.backends.paged`; both 0 on a runtime without one).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUCKETS = (0, 1, 4, 16, 64, 256, 1024, 4096)
GOODPUT_WEIGHT = 0.2  # of the newest pass in the goodput gauge


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
        self.pass_queue = Histogram("spececd_pass_queue_seconds",
                                    "A verification's wait for its pass to start",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.pass_forward = Histogram("spececd_pass_forward_seconds",
                                      "The target's forward in a pass",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.pass_work = Histogram("spececd_pass_work_seconds",
                                   "A pass on the model's thread: forward, logits processing, "
                                   "verification", buckets=LATENCY_BUCKETS, registry=r)
        self.pass_seconds = Histogram("spececd_pass_seconds",
                                      "A pass as the event loop sees it, hand-offs included",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.pass_prompt_tokens = Histogram(
            "spececd_pass_prompt_tokens", "Context tokens a pass prefilled (prompts, chunks)",
            buckets=TOKEN_BUCKETS, registry=r)
        self.pass_offered = Histogram(
            "spececd_pass_offered_positions", "Drafted positions offered to a pass",
            buckets=TOKEN_BUCKETS, registry=r)
        self.pass_verified = Histogram(
            "spececd_pass_verified_positions", "Drafted positions a pass verified",
            buckets=TOKEN_BUCKETS, registry=r)
        self.pass_accepted = Histogram(
            "spececd_pass_accepted_tokens", "Drafted tokens a pass kept",
            buckets=TOKEN_BUCKETS, registry=r)
        self.goodput = Gauge("spececd_goodput_tokens_per_second",
                             "Tokens emitted per second of pass work, over the last passes",
                             registry=r)
        self.token_budget = Gauge("spececd_token_budget",
                                  "Positions a pass may compute now (0: no budget)",
                                  registry=r)
        self._goodput = 0.0
        self.active_sessions = Gauge("spececd_active_sessions", "Open sessions", registry=r)
        self.kv_bytes = Gauge("spececd_kv_bytes", "Bytes held in KV caches", registry=r)
        self.pass_cost_error = Gauge(
            "spececd_pass_cost_fit_error",
            "Mean |actual - predicted| / actual of the token budget's pass-cost fit", registry=r)
        self.kv_pages_used = Gauge("spececd_kv_pages_used",
                                   "Pages of the KV page pool held by sessions", registry=r)
        self.kv_pages_free = Gauge("spececd_kv_pages_free",
                                   "Pages of the KV page pool free", registry=r)
        self.errors = Counter("spececd_errors", "Typed errors answered", ["code"], registry=r)
        self.kv_evictions = Counter("spececd_kv_evictions",
                                    "KV caches freed to stay under --max-kv-bytes", registry=r)
        self.abandoned = Counter("spececd_abandoned_passes",
                                 "Rounds dropped because their client left before they ran",
                                 registry=r)

    def record_batch(self, size: int, forward_s: float, work_s: float, seconds: float,
                     waits: list[float]) -> None:
        """One batched pass of ``size`` sessions: its forward, its work on the model's
        thread and its whole duration, and each job's wait for it."""
        self.batch_size.observe(size)
        self.pass_forward.observe(forward_s)
        self.pass_work.observe(work_s)
        self.pass_seconds.observe(seconds)
        for wait in waits:
            self.pass_queue.observe(wait)

    def record_budget(self, prompt: int, offered: int, verified: int, accepted: int,
                      answered: int, work_s: float, budget: int | None) -> None:
        """One pass under the token budget: ``prompt`` context tokens prefilled,
        ``offered`` drafted positions sent, ``verified`` of them verified, ``accepted`` of
        those kept, ``answered`` sessions given a token, in ``work_s`` seconds of work;
        ``budget``: positions a pass may compute now (None: no budget)."""
        self.pass_prompt_tokens.observe(prompt)
        self.pass_offered.observe(offered)
        self.pass_verified.observe(verified)
        self.pass_accepted.observe(accepted)
        if work_s > 0:
            rate = (answered + accepted) / work_s
            self._goodput += GOODPUT_WEIGHT * (rate - self._goodput) if self._goodput else rate
            self.goodput.set(self._goodput)
        self.token_budget.set(budget or 0)

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
        """Every metric in Prometheus' text format: SpecECD's, then the runner's own."""
        return b"".join(generate_latest(r) for r in (self.registry, *self.also))

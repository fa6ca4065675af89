"""What the cloud service asks of whatever runs the target model: the model runner.

The service (:mod:`spececd.cloud.engine`) owns links, sessions, limits, draining, metrics
and the one stream-generation loop; a runner owns only model work. Two implement it:
:class:`~spececd.cloud.builtin.BuiltinRunner` (a backend in this process, sessions batched
into one forward pass) and :class:`~spececd.cloud.vllm.VllmRunner` (vLLM's engine). The
service calls a runner; a runner never calls the service back.

A runner keeps what it holds for a session (a KV cache, a request) under the session's id
and frees it on :meth:`ModelRunner.forget`. Every failure of model work is a
:class:`RunnerError`, which the service answers with a typed error frame.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from spececd.backends.base import Tokenizer
from spececd.core.logprobs import Logprobs
from spececd.core.sampling import Mode, SamplingParams
from spececd.core.verify import VerifyResult
from spececd.protocol.cloud_session import CloudSession, StepOut, VerifyRequest


class RunnerError(Exception):
    """Model work failed for one request (the message says why); the session stays open.
    When :meth:`ModelRunner.alive` turns false as well, the runner is gone for good."""


@dataclass(frozen=True)
class Pass:
    """A verification's outcome: its result, the duration of the pass it ran in, and how
    many sessions that pass verified together."""

    result: VerifyResult
    seconds: float
    batch: int
    logprobs: Logprobs | None = None  # of the tokens it emits, when the session asked
    prompt_logprobs: Logprobs | None = None  # of the context (echo), when the request asked


class Target(Protocol):
    """What the service reads of the model it serves; a
    :class:`~spececd.backends.base.Backend` has all of it."""

    @property
    def description(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_context(self) -> int: ...
    @property
    def kv_bytes_per_token(self) -> int:
        """0: the KV cache is not the service's to count."""
        ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def tree_attention(self) -> bool: ...


class Generation(Protocol):
    """A cloud-only generation on the runner, stepped by the service's stream loop; each
    step records what it emitted in the session (:meth:`CloudSession.tokens`), which
    queues the ``Tokens`` frame.

    ``continuous``: the runner generates on its own and takes the edge's hints as they
    arrive (:meth:`hinted`), so the service reads frames while a step runs and never waits
    for a hint; otherwise a step starts when asked and verifies the hint as it is then, so
    the service takes frames between steps and may wait for a hint before one."""

    continuous: bool

    async def step(self) -> StepOut:
        """The next step; raises :class:`RunnerError` when it fails."""
        ...

    def hinted(self) -> None:
        """The session's hint may have changed."""

    async def close(self) -> None:
        """Stop generating (abort what runs); idempotent."""


class ModelRunner(Protocol):
    @property
    def name(self) -> str:
        """As ``spececd serve --engine`` names it."""
        ...

    @property
    def target(self) -> Target: ...

    def unsupported(self, mode: Mode, params: SamplingParams) -> str:
        """Why this runner cannot serve a session in ``mode`` with ``params`` ("" when it
        can); the hello is then refused with an ``unsupported`` error."""
        ...

    async def verify(self, key: str, request: VerifyRequest) -> Pass:
        """Verify one session's draft (batched with other sessions' where the runner
        can); raises :class:`RunnerError`."""
        ...

    def generation(self, key: str, session: CloudSession) -> Generation:
        """Start the generation under way in ``session`` (``session.stream``)."""
        ...

    def forget(self, key: str) -> None:
        """Free what the runner holds for a session (it may come back: then from scratch)."""

    def kv_tokens(self, key: str) -> int:
        """Tokens of KV cache the runner holds for a session (0: none, or not counted)."""
        ...

    def alive(self) -> bool:
        """Whether the runner can still serve (``/healthz``)."""
        ...

    def status(self) -> dict[str, object]:
        """The runner's own counters, merged into the service's ``/status``."""
        ...

    def close(self) -> None:
        """Stop the runner and free what it holds."""

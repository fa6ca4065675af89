"""What the cloud service asks of whatever runs the target model: the model runner.

The service (:mod:`spececd.cloud.service`) owns links, sessions, limits, draining, metrics
and the one stream-generation loop; a runner owns only model work. Runners are found by
name in :mod:`spececd.cloud.runners`: :class:`~spececd.cloud.builtin.BuiltinRunner` (a
backend in this process, sessions batched into one packed forward pass over KV pages,
:mod:`spececd.backends.paged`, in fixed shapes replayed from CUDA graphs on a GPU) and
:class:`~spececd.cloud.vllm.VllmRunner` (vLLM's engine). The service calls a runner; a
runner never calls the service back, and never writes into a session: it returns what a
pass or a step produced (:class:`Pass`, :class:`EngineStep`) and the service records it.

A runner keeps what it holds for a session (a KV cache, a request) under the session's id
and frees it on :meth:`ModelRunner.forget`. Every failure of model work is a
:class:`RunnerError`, which the service answers with a typed error frame.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from spececd.backends.base import Tokenizer
from spececd.core.logprobs import Logprobs
from spececd.core.params import Mode, SamplingParams
from spececd.core.verify import VerifyResult
from spececd.errors import InputError
from spececd.protocol.cloud_session import GenerateRequest, VerifyRequest


@dataclass(frozen=True)
class RunnerConfig:
    """How the target runs, resolved once from ``[server]`` settings and flags: where (``device``,
    ``dtype``, ``threads``: 0 for the runner's choice, ``npu``), how many sessions one pass
    verifies at most (``max_batch``), the KV bytes held across sessions at most
    (``max_kv_bytes``, 0: no cap; the built-in runner), the built-in runner's fixed shapes
    and CUDA graphs (``static``: ``auto`` on a GPU only, ``on``, ``off``), the positions
    one pass computes at most (``token_budget``: ``auto``, learned from what passes cost
    and bounded by ``pass_latency_ms``; ``off``: everything queued in one pass; or a
    number; see :mod:`spececd.core.budget`), the positions any pass computes whatever the
    budget (``max_batched_tokens``: prompts past it go in chunks) and vLLM's own settings."""

    device: str = "auto"
    dtype: str = "auto"
    threads: int = 0
    npu: bool = True
    max_batch: int = 32
    max_kv_bytes: int = 0
    static: str = "auto"
    token_budget: str = "auto"
    pass_latency_ms: float = 100.0
    # Positions one pass computes at most whatever the budget (0: no cap), a bound from
    # memory: vLLM's max_num_batched_tokens, whose default its OpenAI server takes on CPUs
    # and most GPUs.
    max_batched_tokens: int = 2048
    tensor_parallel_size: int = 1  # vLLM only
    engine_args: str = ""  # vLLM only: a JSON object of further engine arguments

    def budget(self) -> int | None:
        """``token_budget`` as a number of positions per pass: None for ``auto``, 0 for
        ``off``. Raises :class:`~spececd.errors.InputError` for anything else, or for a
        ``pass_latency_ms`` not above 0."""
        if not self.pass_latency_ms > 0:
            raise InputError(f"pass_latency_ms must be above 0, got {self.pass_latency_ms:g}")
        if self.max_batched_tokens < 0:
            raise InputError(f"max_batched_tokens must be 0 (no cap) or more, got "
                             f"{self.max_batched_tokens}")
        value = str(self.token_budget).strip().lower()
        if value == "auto":
            return None
        if value == "off":
            return 0
        if value.isdigit() and int(value) > 0:
            return int(value)
        raise InputError(f"token_budget takes auto, off or a number of positions above 0, "
                         f"got {self.token_budget!r}")


class RunnerError(Exception):
    """Model work failed for one request (the message says why); the session stays open.
    When :meth:`ModelRunner.alive` turns false as well, the runner is gone for good."""


@dataclass(frozen=True)
class Pass:
    """A verification's outcome: its result, the duration of the pass it ran in, how many
    sessions that pass verified together, how many leading draft positions it verified
    (``verified``; -1: all), and the session's budget for its next request (``budget``:
    the leading positions the server expects to verify; None: no limit)."""

    result: VerifyResult
    seconds: float
    batch: int
    logprobs: Logprobs | None = None  # of the tokens it emits, when the session asked
    prompt_logprobs: Logprobs | None = None  # of the context (echo), when the request asked
    budget: int | None = None
    verified: int = -1


class Target(Protocol):
    """What the service reads of the model it serves; a
    :class:`~spececd.backends.base.Backend` has all of it."""

    @property
    def description(self) -> str:
        """The model, its runtime and settings, for logs and ``/status``."""
        ...
    @property
    def vocab_size(self) -> int:
        """Token ids the target's tokenizer has (the fingerprint's)."""
        ...
    @property
    def max_context(self) -> int:
        """Positions the target takes at most (the service's limit is at most this)."""
        ...
    @property
    def kv_bytes_per_token(self) -> int:
        """0: the KV cache is not the service's to count."""
        ...
    @property
    def tokenizer(self) -> Tokenizer:
        """The target's tokenizer (its fingerprint, constraints, the tokenizer bundle)."""
        ...
    @property
    def tree_attention(self) -> bool:
        """Whether the runner verifies token trees (else the hello refuses them)."""
        ...


@dataclass(frozen=True)
class EngineStep:
    """One step of a runner's own generation: the tokens it emitted, the seconds since the
    step before, and whether the engine ended the request (it may end it before SpecECD's
    own limits would: the service then answers an error)."""

    tokens: tuple[int, ...]
    seconds: float
    finished: bool


class Generation(Protocol):
    """A cloud-only generation that a runner runs on its own (vLLM), taking the edge's
    hints as they arrive (:meth:`hinted`); the service reads frames while a step runs,
    never waits for a hint, and records each step in the session."""

    async def step(self) -> EngineStep:
        """The next step; raises :class:`RunnerError` when it fails."""
        ...

    def hinted(self, start: int, hint: tuple[int, ...]) -> None:
        """The edge's hint is now ``hint``, for the positions from ``start`` on."""

    async def close(self) -> None:
        """Stop generating (abort what runs); idempotent."""


class ModelRunner(Protocol):
    @property
    def name(self) -> str:
        """As ``spececd serve --engine`` names it."""
        ...

    @property
    def target(self) -> Target:
        """The model it serves, as the service reads it."""
        ...

    @property
    def width(self) -> int:
        """The longest draft it verifies in one pass (0: any the limits allow), told to
        edges as the Welcome's ``width``."""
        ...

    def unsupported(self, mode: Mode, params: SamplingParams) -> str:
        """Why this runner cannot serve a session in ``mode`` with ``params`` ("" when it
        can); the hello is then refused with an ``unsupported`` error."""
        ...

    async def verify(self, key: str, request: VerifyRequest) -> Pass:
        """Verify one session's draft (batched with other sessions' where the runner
        can); raises :class:`RunnerError`."""
        ...

    def generation(self, key: str, request: GenerateRequest, hint_start: int,
                   hint: tuple[int, ...]) -> Generation | None:
        """Start ``request`` as a generation of the runner's own, with the edge's hint so
        far; None where the runner has none: the service then steps the generation by
        verifying the hint ahead of the context (:meth:`verify`), one pass a step."""
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

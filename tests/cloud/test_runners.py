"""Runner conformance: every model runner, under the one service, answers a round and a
cloud-only generation (no hint, a right hint, a wrong one) with the target's own greedy
tokens, ends a generation at its limit, and frees what it holds for a session.

Runners: the built-in one over the toy target, over a tiny Llama on its packed, paged path
(:mod:`spececd.backends.paged`) as off CUDA and in the fixed shapes of CUDA graphs (eager
here), a scripted runner with a
generation of its own (stepping as vLLM's does: the hint's agreeing tokens and one more),
and vLLM where installed (slow: its engine takes half a minute to start).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from spececd.backends.base import Backend, tokenizer_fingerprint
from spececd.cloud import runners
from spececd.cloud.builtin import BuiltinRunner
from spececd.cloud.metrics import Metrics
from spececd.cloud.runner import EngineStep, ModelRunner, RunnerConfig, Target
from spececd.cloud.service import CloudService
from spececd.core.tokens import common_prefix
from spececd.protocol import messages as m
from spececd.protocol.cloud_session import GenerateRequest, Limits
from tests.support.protocol import hello as support_hello
from tests.toy import ToyBackend, ToyModel

Greedy = Callable[[Sequence[int], int], list[int]]
# One event loop for the module, as a server has: vLLM's engine client serves its outputs on
# the loop it first ran on.
LOOP = asyncio.new_event_loop()


@dataclass
class Subject:
    """A runner under test, and the target's own greedy continuation for it."""

    runner: ModelRunner
    greedy: Greedy
    prompt: tuple[int, ...]


def backend_greedy(backend: Backend) -> Greedy:
    """``n`` greedy tokens after ``prompt``, each from a fresh sequence of ``backend``."""
    def greedy(prompt: Sequence[int], n: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(n):
            logits = backend.new_sequence().extend(tokens, keep=1)
            tokens.append(int(np.argmax(logits[-1])))
        return tokens[len(prompt):]
    return greedy


class OwnSteps:
    """A generation of the runner's own over a backend: each step emits the hint's tokens
    that the target's greedy choice agrees with, and the target's next token."""

    def __init__(self, greedy: Greedy, request: GenerateRequest, hint_start: int,
                 hint: tuple[int, ...]) -> None:
        self._greedy, self._request = greedy, request
        self._context = list(request.context)
        self._hint = (hint_start, hint)
        self._generated = 0
        self.closed = False

    def hinted(self, start: int, hint: tuple[int, ...]) -> None:
        self._hint = (start, hint)

    async def step(self) -> EngineStep:
        start, hint = self._hint
        ahead = hint[len(self._context) - start:] if start <= len(self._context) else ()
        room = self._request.max_tokens - self._generated
        own = self._greedy(self._context, min(len(ahead), room - 1) + 1)
        emitted = own[:common_prefix(own, ahead) + 1][:room]
        self._context += emitted
        self._generated += len(emitted)
        return EngineStep(tuple(emitted), 0.001, self._generated >= self._request.max_tokens)

    async def close(self) -> None:
        self.closed = True


class ScriptedRunner(BuiltinRunner):
    """The built-in runner's rounds, and a generation of its own (:class:`OwnSteps`)."""

    name = "scripted"

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend, Metrics())
        self._greedy = backend_greedy(backend)

    def generation(self, key: str, request: GenerateRequest, hint_start: int,
                   hint: tuple[int, ...]) -> OwnSteps:
        return OwnSteps(self._greedy, request, hint_start, hint)


TOY_PROMPT = (5, 17, 42, 99, 3)
KINDS = ["builtin-toy", "builtin-llama", "builtin-llama-fixed", "scripted-toy",
         pytest.param("vllm", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def vllm() -> Iterator[tuple[ModelRunner, Greedy, tuple[int, ...]]]:
    """vLLM's runner on the default target, one engine for the module (it takes half a
    minute to start), and transformers' greedy decoding of the same model (equal ids)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (bash scripts/install-vllm.sh)")
    from spececd.backends.hf import HFBackend

    saved = dict(os.environ)
    os.environ.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
                       "VLLM_LOGGING_LEVEL": "WARNING"})
    try:
        target = str(Path(__file__).parents[2] / "models" / "target")
        reference = HFBackend(target, device="cpu", dtype="float32")
        config = RunnerConfig(dtype="float32", max_batch=4,
                              engine_args='{"gpu_memory_utilization": 0.3}')
        runner = runners.start("vllm", target, config, Limits(max_context=512), Metrics())
    finally:
        os.environ.clear()
        os.environ.update(saved)
    yield runner, backend_greedy(reference), tuple(reference.tokenizer.encode("def main("))
    runner.close()


@pytest.fixture(params=KINDS)
def subject(request: pytest.FixtureRequest) -> Iterator[Subject]:
    kind: str = request.param
    if kind.endswith("-toy"):
        toy = ToyBackend(ToyModel(seed=0))
        runner: ModelRunner = (BuiltinRunner(toy, Metrics()) if kind.startswith("builtin")
                               else ScriptedRunner(toy))
        yield Subject(runner, backend_greedy(toy), TOY_PROMPT)
        return
    if kind == "vllm":
        yield Subject(*request.getfixturevalue("vllm"))
        return
    pytest.importorskip("torch")
    from spececd.backends.hf import HFBackend

    tiny: dict[str, Path] = request.getfixturevalue("tiny_models")
    reference = HFBackend(str(tiny["llama"]), device="cpu", dtype="float32")
    config = RunnerConfig(device="cpu", dtype="float32",
                          static="on" if kind.endswith("fixed") else "off")
    runner = runners.start("builtin", str(tiny["llama"]), config, Limits(), Metrics())
    assert "paged KV" in runner.target.description
    assert ("fixed shapes" in runner.target.description) == kind.endswith("fixed")
    prompt = tuple(reference.tokenizer.encode("def main(") or [1, 2, 3])
    yield Subject(runner, backend_greedy(reference), prompt)
    runner.close()


def hello(target: Target) -> bytes:
    """A greedy hello for ``target``."""
    return support_hello(tokenizer_fingerprint(target.tokenizer, target.vocab_size), "greedy")


def serve(service: CloudService, frames: Sequence[bytes], done: int,
          keys: list[str] | None = None) -> list[m.Message]:
    """The replies to ``frames`` on one link, until ``done`` replies ended a request (a
    verdict, or a generation's last tokens) or an error came; the link's key goes into
    ``keys``."""
    replies: list[m.Message] = []

    async def main() -> None:
        link = service.open()
        if keys is not None:
            keys.append(link.key)
        for frame in frames:
            link.put(frame)

        async def send(frame: bytes) -> None:
            replies.append(m.decode(frame))
            ended = [r for r in replies if isinstance(r, m.Verdict | m.Error)
                     or (isinstance(r, m.Tokens) and r.done)]
            if len(ended) >= done:
                link.end()

        await asyncio.wait_for(service.serve(link, send), 120)

    LOOP.run_until_complete(main())
    return replies


def tokens_of(replies: list[m.Message]) -> list[int]:
    assert not [r for r in replies if isinstance(r, m.Error)], replies
    return [t for r in replies if isinstance(r, m.Tokens) for t in r.token_ids]


def test_a_round_keeps_the_agreeing_draft_and_adds_the_targets_token(
        subject: Subject) -> None:
    expected = subject.greedy(subject.prompt, 5)
    draft = (*expected[:2], (expected[2] + 1) % subject.runner.target.vocab_size)
    service = CloudService(subject.runner)
    replies = serve(service, [hello(subject.runner.target),
                              m.encode(m.Draft(1, 0, subject.prompt, draft))], done=1)
    verdicts = [r for r in replies if isinstance(r, m.Verdict)]
    assert [(v.num_accepted, v.next_token) for v in verdicts] == [(2, expected[2])], replies


@pytest.mark.parametrize("hint", ["none", "right", "wrong"])
def test_a_generation_gives_the_targets_tokens_whatever_the_hint(
        subject: Subject, hint: str) -> None:
    n = 10
    expected = subject.greedy(subject.prompt, n)
    vocab = subject.runner.target.vocab_size
    frames = [hello(subject.runner.target), m.encode(m.Generate(1, 0, subject.prompt, n))]
    if hint != "none":
        hinted = expected[:5] if hint == "right" else [(t + 1) % vocab for t in expected[:5]]
        frames.append(m.encode(m.Hint(len(subject.prompt), tuple(hinted))))
    service = CloudService(subject.runner)
    replies = serve(service, frames, done=1)
    assert tokens_of(replies) == expected
    chunks = [r for r in replies if isinstance(r, m.Tokens)]
    assert chunks[-1].done and sum(r.accepted for r in chunks) <= sum(r.drafted for r in chunks)
    if hint == "wrong":
        assert sum(r.accepted for r in chunks) == 0


def test_a_generation_ends_at_max_tokens_and_the_session_is_forgotten(
        subject: Subject) -> None:
    expected = subject.greedy(subject.prompt, 3)
    service = CloudService(subject.runner)
    keys: list[str] = []
    frames = [hello(subject.runner.target), m.encode(m.Generate(1, 0, subject.prompt, 3))]
    replies = serve(service, frames, done=1, keys=keys)
    assert tokens_of(replies) == expected
    assert not service.links and subject.runner.kv_tokens(keys[0]) == 0  # released
    assert subject.runner.alive() and isinstance(subject.runner.status(), dict)


def test_a_sessions_acceptance_is_kept_per_draft_source() -> None:
    """An edge that sends trees and chains in turn keeps what each taught: a session's
    acceptance is one per draft source (one per session, started over whenever the source
    changed, never grew past a round), and forgetting the session drops them all."""
    import dataclasses

    from spececd.core.params import Mode, SamplingParams
    from spececd.protocol.cloud_session import VerifyRequest

    runner = BuiltinRunner(ToyBackend(ToyModel(seed=0)), Metrics())
    chain = VerifyRequest(seq=1, context=(1, 2), tokens=(3, 4), draft_probs=None,
                          mode=Mode.GREEDY, params=SamplingParams(temperature=0.0, seed=0))
    tree = dataclasses.replace(chain, parents=(-1, 0))
    first = runner._accepting("s", tree)
    first.observe(2, 0)
    assert runner._accepting("s", chain) is not first
    assert runner._accepting("s", tree) is first
    runner.forget("s")
    assert runner._accepting("s", tree) is not first

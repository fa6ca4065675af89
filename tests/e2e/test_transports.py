"""One end-to-end suite over every transport: memory (in-process, on the engine's
background loop), WebSocket, gRPC and HTTP. One fixture, ``cloud``, is parametrized over
them, the way uvicorn runs one suite over its implementations; each networked case talks
to a real ``spececd serve`` subprocess on loopback that opens all three listeners.

What every transport must show: greedy output identical to the target alone (a tiny
Llama, a tiny Qwen2, the default pair), the target's exact distribution when sampling
(chi-square, exact and match mode), resume after the server is killed, auth and TLS,
limits answered with typed errors, and a fuzzer of 1,000 hostile frames (10,000 when
slow) that leaves legitimate sessions' output unchanged.
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("grpc")

from spececd.backends.base import tokenizer_fingerprint
from spececd.backends.registry import load_backend
from spececd.cloud.runners import builtin_service
from spececd.core.params import SamplingParams
from spececd.edge.client import CloudUnreachable, Reconnect
from spececd.edge.transport import Transport
from spececd.generator import Generator
from spececd.protocol import messages as m
from spececd.protocol.cloud_session import Limits
from spececd.protocol.errors import AuthFailed, ProtocolError
from spececd.transports.memory import LocalServer
from spececd.transports.registry import connector
from tests.builders import MODELS, requires_default_pair
from tests.chisq import PAIR_DRAWS, chi_square_p
from tests.e2e.server import ALL_LISTENERS, ServerProcess, free_port
from tests.fuzz import bad_frames, mutate, structured_junk
from tests.reference import FIXED_K, PROMPTS, exact_pair_distribution, hf_greedy

TRANSPORTS = ["memory", "websocket", "grpc", "http"]
SCHEMES = {"websocket": "ws", "grpc": "grpc", "http": "http"}


class Cloud:
    """A verifier for ``target`` reached over ``transport``: in this process (memory) or
    through ``proc``'s listener for it."""

    def __init__(self, transport: str, target: Path, proc: ServerProcess | None,
                 limits: Limits | None = None) -> None:
        self.transport, self.target, self.proc = transport, target, proc
        self._local: LocalServer | None = None
        self._limits = limits

    @property
    def url(self) -> str:
        assert self.proc is not None, "an in-process verifier has no URL"
        scheme = SCHEMES[self.transport]
        return next(url for s, url in self.proc.urls.items() if s in (scheme, scheme + "s"))

    def generator(self, draft: Path, **kw: Any) -> Generator:
        if self.proc is None:
            return Generator.load(str(draft), str(self.target), device="cpu", dtype="float32",
                                  **kw)
        return Generator.load(str(draft), server=self.url, device="cpu", dtype="float32", **kw)

    def link(self) -> Transport:
        """A raw link (frames in, frames out) to this verifier."""
        if self.proc is not None:
            return connector(self.url, recv_timeout=10.0)()
        if self._local is None:
            backend = load_backend(str(self.target), device="cpu", dtype="float32")
            self._local = LocalServer(builtin_service(backend, self._limits))
        return self._local()

    def errors_sent(self) -> int:
        """How many error frames the verifier behind :meth:`link` has answered, by its own
        count."""
        return sum(self.errors_by_code().values())

    def errors_by_code(self) -> dict[str, int]:
        if self.proc is not None:
            return dict(self.proc.status()["errors"])
        return dict(self._local.engine.status()["errors"]) if self._local else {}

    def close(self) -> None:
        if self._local is not None:
            self._local.close()


def networked(transport: str) -> None:
    if transport == "memory":
        pytest.skip("an in-process verifier has no server to kill, no auth and no TLS")


@pytest.fixture(scope="module")
def tiny_server(shared_server: Callable[[Path], ServerProcess],
                tiny_models: dict[str, Path]) -> ServerProcess:
    return shared_server(tiny_models["llama"])


@pytest.fixture(params=TRANSPORTS)
def cloud(request: pytest.FixtureRequest, tiny_server: ServerProcess,
          tiny_models: dict[str, Path]) -> Iterator[Cloud]:
    transport = request.param
    made = Cloud(transport, tiny_models["llama"], None if transport == "memory" else tiny_server)
    yield made
    made.close()


# -- lossless ---------------------------------------------------------------------------


@pytest.mark.parametrize("k,proactive", [(4, "off"), ("auto", "on"), ("auto", "stream")])
def test_greedy_is_identical_to_the_target_alone(
        k: int | str, proactive: str, cloud: Cloud, tiny_models: dict[str, Path]) -> None:
    with cloud.generator(tiny_models["draft"], k=k, proactive=proactive) as gen:
        for prompt in PROMPTS[:3]:
            ids = gen.prompt_ids(prompt)
            out = gen.generate(ids, max_tokens=30, temperature=0, stop_token_ids=[])
            assert out.token_ids == hf_greedy(tiny_models["llama"], ids, 30)


@pytest.mark.parametrize("draft,proactive", [("lookup", "off"), ("suffix", "on"),
                                             ("hybrid", "stream")])
def test_drafts_without_a_model_are_identical_to_the_target_alone(
        draft: str, proactive: str, cloud: Cloud, tiny_models: dict[str, Path]) -> None:
    """Lookup in plain rounds, suffix drafting ahead of the verdicts, the hybrid in stream
    drafting's hints; the prompts repeat themselves, so the lookups find something (in
    rounds; whether the server is still there to take a hint is a matter of timing)."""
    with cloud.generator(tiny_models["draft"], k="auto", proactive=proactive,
                         draft_source=draft) as gen:
        looked_up = 0
        for prompt in PROMPTS[:3]:
            ids = gen.prompt_ids(prompt * 3)
            out = gen.generate(ids, max_tokens=30, temperature=0, stop_token_ids=[])
            assert out.token_ids == hf_greedy(tiny_models["llama"], ids, 30)
            looked_up += out.stats.lookup_accepted
        assert looked_up > 0 or proactive == "stream"


@pytest.mark.parametrize("kind", ["json_schema", "regex"])
def test_greedy_under_a_constraint_is_the_target_alone_constrained(
        kind: str, cloud: Cloud, tiny_models: dict[str, Path]) -> None:
    """The constraint travels in the hello: the server masks, the edge drafts under it."""
    pytest.importorskip("xgrammar")
    from tests.e2e.test_constrained_models import CONSTRAINTS, hf_constrained_greedy

    with cloud.generator(tiny_models["draft"], k=4, proactive="on") as gen:
        ids = gen.prompt_ids(PROMPTS[0])
        out = gen.generate(ids, max_tokens=24, temperature=0, constraint=CONSTRAINTS[kind])
        assert out.token_ids == hf_constrained_greedy(tiny_models["llama"], ids,
                                                      CONSTRAINTS[kind], 24)


@pytest.mark.parametrize("mode,proactive", [("greedy", "off"), ("exact", "on")])
def test_greedy_token_trees_are_identical_to_the_target_alone(
        mode: str, proactive: str, cloud: Cloud, tiny_models: dict[str, Path]) -> None:
    with cloud.generator(tiny_models["draft"], k=4, mode=mode, proactive=proactive,
                         tree_width=3) as gen:
        siblings = 0
        for prompt in PROMPTS[:3]:
            ids = gen.prompt_ids(prompt)
            out = gen.generate(ids, max_tokens=30, temperature=0, stop_token_ids=[])
            assert out.token_ids == hf_greedy(tiny_models["llama"], ids, 30)
            siblings += out.stats.tree_siblings
        assert siblings > 0  # trees were drafted and verified, not chains alone


@pytest.fixture(scope="module")
def qwen_server(tiny_models: dict[str, Path]) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_models["qwen2"], *ALL_LISTENERS)
    yield proc
    proc.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_tiny_qwen2_target_is_identical_too(transport: str, qwen_server: ServerProcess,
                                              tiny_models: dict[str, Path]) -> None:
    cloud = Cloud(transport, tiny_models["qwen2"],
                  None if transport == "memory" else qwen_server)
    with cloud.generator(tiny_models["draft"], k="auto") as gen:
        ids = gen.prompt_ids(PROMPTS[4])
        out = gen.generate(ids, max_tokens=30, temperature=0, stop_token_ids=[])
        assert out.token_ids == hf_greedy(tiny_models["qwen2"], ids, 30)


@pytest.fixture(scope="module")
def default_server(shared_server: Callable[[Path], ServerProcess]) -> ServerProcess:
    return shared_server(MODELS / "target")


_DEFAULT_REFERENCE: dict[tuple[int, ...], list[int]] = {}


@requires_default_pair
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_default_pair_is_identical_to_its_target_alone(
        transport: str, default_server: ServerProcess) -> None:
    prompts = json.loads((MODELS / "heldout_prompts.json").read_text())[:4]
    cloud = Cloud(transport, MODELS / "target",
                  None if transport == "memory" else default_server)
    with cloud.generator(MODELS / "draft", k="auto") as gen:
        for prompt in prompts:
            ids = gen.prompt_ids(prompt)
            out = gen.generate(ids, max_tokens=32, temperature=0, stop_token_ids=[])
            key = tuple(ids)
            if key not in _DEFAULT_REFERENCE:
                _DEFAULT_REFERENCE[key] = hf_greedy(MODELS / "target", ids, 32)
            assert out.token_ids == _DEFAULT_REFERENCE[key], prompt


@pytest.fixture(scope="module")
def vocab_server(shared_server: Callable[[Path], ServerProcess],
                 tiny_vocab_pair: dict[str, Path]) -> ServerProcess:
    return shared_server(tiny_vocab_pair["target"])


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode,temperature,top_p", [("exact", 1.0, 0.9), ("match", 0.8, 1.0)])
def test_sampling_keeps_the_target_distribution(
        transport: str, mode: str, temperature: float, top_p: float,
        vocab_server: ServerProcess, tiny_vocab_pair: dict[str, Path]) -> None:
    cloud = Cloud(transport, tiny_vocab_pair["target"],
                  None if transport == "memory" else vocab_server)
    assert sampled_pairs_p(cloud, tiny_vocab_pair, mode, temperature, top_p) > 0.001


@pytest.mark.slow  # a check of the test above (of its draws), not of SpecECD: 20 s
def test_a_draft_distribution_shifted_on_the_wire_is_caught(
        tiny_vocab_pair: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug: the edge draws from its distribution but its frame carries the
    probabilities shifted by one against their ids. The test above, at the same draws, must
    fail it (p = 3e-12 measured: what ``PAIR_DRAWS`` buys). The verifier's own planted bugs
    are tests/core's, in the default suite."""
    from spececd.core.sampling import SparseProbs
    from spececd.protocol.edge_session import EdgeSession

    framed = EdgeSession.draft

    def shifted(self: EdgeSession, history: Any, tokens: tuple[int, ...],
                draft_probs: tuple[SparseProbs, ...] | None, parents: Any = None) -> bytes:
        if draft_probs is not None:
            draft_probs = tuple(SparseProbs(d.ids, np.roll(d.probs, 1)) for d in draft_probs)
        return framed(self, history, tokens, draft_probs, parents)

    monkeypatch.setattr(EdgeSession, "draft", shifted)
    cloud = Cloud("memory", tiny_vocab_pair["target"], None)
    p_value = sampled_pairs_p(cloud, tiny_vocab_pair, "exact", 1.0, 0.9)
    assert p_value < 0.001, p_value


def sampled_pairs_p(cloud: Cloud, pair: dict[str, Path], mode: str, temperature: float,
                    top_p: float) -> float:
    """The chi-square p-value of ``PAIR_DRAWS`` first two tokens drafted by ``pair``'s
    draft (3 a round, ahead of the verdicts) and verified by ``cloud``, against its
    target's own distribution."""
    draws, prompt, vocab = PAIR_DRAWS, [1, 2, 3], 10
    with cloud.generator(pair["draft"], k=3, mode=mode, proactive="on") as gen:
        pairs = [c.token_ids for c in gen.generate_n(
            prompt, draws, max_tokens=2, temperature=temperature, top_p=top_p, seed=1234,
            stop_token_ids=[])]
    assert all(len(p) == 2 for p in pairs)
    observed = np.bincount([a * vocab + b for a, b in pairs], minlength=vocab * vocab)
    expected = exact_pair_distribution(pair["target"], prompt, SamplingParams(
        temperature=temperature, top_p=top_p)) * draws
    return chi_square_p(observed, expected)


@pytest.mark.parametrize("transport,draft,mode", [
    ("memory", "lookup", "exact"), ("memory", "hybrid", "match"),
    ("websocket", "hybrid", "exact")])  # exact: looked-up drafts' one-hot rows on the wire
def test_looked_up_drafts_keep_the_target_distribution(
        transport: str, draft: str, mode: str, vocab_server: ServerProcess,
        tiny_vocab_pair: dict[str, Path]) -> None:
    """A prompt that repeats itself, so that every round has a lookup to propose."""
    draws, prompt, vocab = PAIR_DRAWS, [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6], 10
    cloud = Cloud(transport, tiny_vocab_pair["target"],
                  None if transport == "memory" else vocab_server)
    with cloud.generator(tiny_vocab_pair["draft"], k=3, mode=mode, proactive="off",
                         draft_source=draft) as gen:
        chunks = gen.generate_n(prompt, draws, max_tokens=3, temperature=1.0, seed=1234,
                                stop_token_ids=[])
    assert sum(c.stats.lookup_drafted for c in chunks) >= draws
    observed = np.bincount([c.token_ids[0] * vocab + c.token_ids[1] for c in chunks],
                           minlength=vocab * vocab)
    expected = exact_pair_distribution(tiny_vocab_pair["target"], prompt, SamplingParams(
        temperature=1.0)) * draws
    assert chi_square_p(observed, expected) > 0.001


@pytest.mark.parametrize("transport,mode,temperature,top_p", [  # the same frames on all
    ("memory", "exact", 1.0, 0.9), ("memory", "match", 0.8, 1.0),
    ("websocket", "exact", 1.0, 0.9)])  # exact: the siblings' distributions on the wire
def test_sampled_token_trees_keep_the_target_distribution(
        transport: str, mode: str, temperature: float, top_p: float,
        vocab_server: ServerProcess, tiny_vocab_pair: dict[str, Path]) -> None:
    """Trees of up to 3 candidates per position: siblings drawn without replacement in
    exact mode, the next most likely tokens in match mode."""
    draws, prompt, vocab = PAIR_DRAWS, [1, 2, 3], 10
    cloud = Cloud(transport, tiny_vocab_pair["target"],
                  None if transport == "memory" else vocab_server)
    with cloud.generator(tiny_vocab_pair["draft"], k=3, mode=mode, proactive="off",
                         tree_width=3) as gen:
        chunks = list(gen.generate_n(prompt, draws, max_tokens=2, temperature=temperature,
                                     top_p=top_p, seed=1234, stop_token_ids=[]))
    assert all(len(c.token_ids) == 2 for c in chunks)
    assert sum(c.stats.tree_siblings for c in chunks) > draws  # most rounds branched
    observed = np.bincount([a * vocab + b for a, b in (c.token_ids for c in chunks)],
                           minlength=vocab * vocab)
    expected = exact_pair_distribution(tiny_vocab_pair["target"], prompt, SamplingParams(
        temperature=temperature, top_p=top_p)) * draws
    assert chi_square_p(observed, expected) > 0.001


# -- faults -----------------------------------------------------------------------------


@pytest.mark.parametrize("proactive", ["on", "stream"])
def test_resume_after_the_server_is_killed(proactive: str, cloud: Cloud,
                                           tiny_models: dict[str, Path]) -> None:
    networked(cloud.transport)
    proc = ServerProcess(tiny_models["llama"], "--grpc-port", str(free_port()),
                         "--http-port", str(free_port()))
    try:
        killed = Cloud(cloud.transport, tiny_models["llama"], proc)
        reconnect = Reconnect(attempts=60, delay=0.1, max_delay=0.5)
        with killed.generator(tiny_models["draft"], reconnect=reconnect, k=FIXED_K,
                              proactive=proactive) as gen:
            sampling: dict[str, Any] = dict(max_tokens=40, temperature=0.9, seed=7,
                                            stop_token_ids=[])
            reference = gen.generate(PROMPTS[0], **sampling).token_ids
            tokens: list[int] = []
            for i, chunk in enumerate(gen.stream(PROMPTS[0], **sampling)):
                tokens.extend(chunk.token_ids)
                if i == 3:
                    proc.kill()
                    proc.start()
            assert tokens == reference
    finally:
        proc.stop()


# -- security and bad input -------------------------------------------------------------


@pytest.fixture(scope="module")
def secured(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[ServerProcess, Path]]:
    folder = tmp_path_factory.mktemp("tls")
    cert, key, token = folder / "cert.pem", folder / "key.pem", folder / "token"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    token.write_text("s3cret\n")
    proc = ServerProcess(tiny_models["llama"], *ALL_LISTENERS, "--tls-cert", str(cert),
                         "--tls-key", str(key), "--auth-token-file", str(token), scheme="wss")
    yield proc, cert
    proc.stop()


def test_auth_and_tls(cloud: Cloud, secured: tuple[ServerProcess, Path],
                      tiny_models: dict[str, Path]) -> None:
    networked(cloud.transport)
    proc, cert = secured
    url = Cloud(cloud.transport, tiny_models["llama"], proc).url
    assert url.split("://")[0].endswith("s")  # the TLS scheme of this transport
    once = Reconnect(attempts=0)

    def load(reconnect: Reconnect = once, **kw: Any) -> Generator:
        return Generator.load(str(tiny_models["draft"]), server=url, device="cpu",
                              dtype="float32", reconnect=reconnect, **kw)

    # One CI run saw the first wss:// opening handshake of this server time out (10 s) and
    # never reproduced it; the edge's default is to reconnect, so this one may too.
    with load(Reconnect(attempts=2, delay=0.1), tls_ca=str(cert), auth_token="s3cret") as gen:
        assert len(gen.generate("x", max_tokens=6, temperature=0).token_ids) == 6
    with pytest.raises(AuthFailed), load(tls_ca=str(cert), auth_token="wrong") as gen:
        gen.generate("x", max_tokens=3)
    with pytest.raises(CloudUnreachable), load(auth_token="s3cret") as gen:
        gen.generate("x", max_tokens=3)  # the self-signed certificate is not trusted
    plain = url.replace("s://", "://", 1)
    with pytest.raises(CloudUnreachable), Generator.load(
            str(tiny_models["draft"]), server=plain, device="cpu", dtype="float32",
            reconnect=once, auth_token="s3cret") as gen:
        gen.generate("x", max_tokens=3)  # no TLS against a TLS listener


def greet(link: Transport, draft: Path, mode: str = "match") -> bytes:
    backend = load_backend(str(draft), device="cpu", dtype="float32")
    fingerprint = tokenizer_fingerprint(backend.tokenizer, backend.vocab_size)
    hello = m.encode(m.Hello(m.PROTOCOL_VERSION, fingerprint, mode, 1.0, 0, 1.0, 1, ""))
    link.send(hello)
    assert isinstance(m.decode(link.recv()), m.Welcome)
    return hello


@pytest.fixture(scope="module")
def limited(tiny_models: dict[str, Path]) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_models["llama"], *ALL_LISTENERS, "--max-draft", "3",
                         "--max-message-bytes", "2000", "--max-context", "64")
    yield proc
    proc.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_limits_are_typed_errors(transport: str, limited: ServerProcess,
                                 tiny_models: dict[str, Path]) -> None:
    cloud = Cloud(transport, tiny_models["llama"], None if transport == "memory" else limited,
                  Limits(max_draft=3, max_context=64, max_message_bytes=2000))
    try:
        link = cloud.link()
        greet(link, tiny_models["draft"])
        for code, frames in bad_frames().items():
            for bad in frames:
                link.send(bad)
                reply = m.decode(link.recv())
                assert isinstance(reply, m.Error) and reply.code == code, (code, reply)
        link.send(m.encode(m.Draft(4, 0, (5, 6), (7,), None)))  # the session still works
        assert isinstance(m.decode(link.recv()), m.Verdict)
        link.close()
    finally:
        cloud.close()


def is_hint(frame: bytes) -> bool:
    try:
        return isinstance(m.decode(frame), m.Hint)
    except ProtocolError:
        return False


def answer_within(link: Transport, seconds: float) -> bytes | None:
    """The link's next frame if one arrives within ``seconds``, else None."""
    deadline = time.monotonic() + seconds
    while (frame := link.poll()) is None and time.monotonic() < deadline:
        time.sleep(0.005)
    return frame


def late_errors(link: Transport) -> int:
    """Error frames still to come on ``link`` before it is left: a refused hint's error
    that missed its window (over HTTP it rides on the next request's answer), which then
    shifted every later answer by one."""
    late = 0
    with contextlib.suppress(ConnectionError):
        while (frame := answer_within(link, 0.3)) is not None:
            late += isinstance(m.decode(frame), m.Error)
    return late


@pytest.mark.parametrize("count", [1000, pytest.param(10_000, marks=pytest.mark.slow)])
def test_fuzzing_leaves_legitimate_sessions_unchanged(
        cloud: Cloud, tiny_models: dict[str, Path], count: int) -> None:
    """``count`` hostile frames, while two legitimate sessions generate again and again
    beside them: a sampled one, whose output must equal the same request's before the
    fuzzing, and a greedy one, whose output must equal the target alone's; the server
    serves the same after."""
    sampling: dict[str, Any] = dict(max_tokens=60, temperature=0.8, seed=3, stop_token_ids=[])
    greedy: dict[str, Any] = dict(max_tokens=40, temperature=0, stop_token_ids=[])
    with cloud.generator(tiny_models["draft"], k=FIXED_K, proactive="on") as gen:
        reference = gen.generate(PROMPTS[2], **sampling).token_ids
        alone = hf_greedy(tiny_models["llama"], gen.prompt_ids(PROMPTS[0]), 40)
    legit: dict[str, list[list[int]]] = {"sampled": [], "greedy": []}
    fuzzing = threading.Event()
    fuzzing.set()

    def legitimate(kind: str) -> None:
        prompt, settings = (PROMPTS[2], sampling) if kind == "sampled" else (PROMPTS[0], greedy)
        with cloud.generator(tiny_models["draft"], k=FIXED_K, proactive="on") as g:
            while fuzzing.is_set() or not legit[kind]:
                out: list[int] = []
                for chunk in g.stream(prompt, **settings):
                    out.extend(chunk.token_ids)
                    time.sleep(0.02)  # keep the session alive across the fuzzing
                legit[kind].append(out)

    threads = [threading.Thread(target=legitimate, args=(kind,)) for kind in legit]
    for thread in threads:
        thread.start()
    rng = random.Random(count)
    link: Transport | None = None
    hello = b""
    seeds: list[bytes] = []
    counts = {"frames": 0, "errors": 0, "answers": 0, "closes": 0, "hints": 0}
    errors_before = cloud.errors_sent()
    codes: Counter[str] = Counter()
    while counts["frames"] < count:
        if link is None:
            link = cloud.link()
            if not seeds or rng.random() < 0.5:  # fuzz a greeted session half of the time
                hello = greet(link, tiny_models["draft"], "exact")
                seeds = [hello, m.encode(m.Draft(1, 0, (5, 6), (7, 8), None)),
                         m.encode(m.Verdict(1, 0, 1, 0.0)), m.encode(m.Close("x"))]
        kind = rng.random()
        frame = (bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))) if kind < 0.3
                 else structured_junk(rng) if kind < 0.6 else mutate(rng.choice(seeds), rng))
        counts["frames"] += 1
        try:
            link.send(frame)
            if is_hint(frame):  # a hint gets no answer of its own, unless it is refused
                answer = answer_within(link, 5.0)  # a refusal may be slow under load
                if answer is None:
                    counts["hints"] += 1
                    continue
                reply = m.decode(answer)
            else:
                reply = m.decode(link.recv())
        except ConnectionError:
            counts["closes"] += 1  # closed by the server (a fatal error or a Close frame)
            link.close()
            link = None
            continue
        counts["errors" if isinstance(reply, m.Error) else "answers"] += 1
        if isinstance(reply, m.Error):
            codes[reply.code] += 1
        if isinstance(reply, m.Error) and reply.fatal:
            counts["errors"] += late_errors(link)
            link.close()
            link = None
    if link is not None:
        counts["errors"] += late_errors(link)
        link.close()  # (the server outlives this module: test files share it)
    fuzzing.clear()
    for thread in threads:
        thread.join(timeout=180)
    print(f"fuzz over {cloud.transport}: {counts}; legitimate generations, all unchanged: "
          f"{ {kind: len(outs) for kind, outs in legit.items()} }")
    # Every error the server counted reached the fuzzer as a typed frame, and nothing else
    # did: the legitimate sessions made none.
    assert cloud.errors_sent() - errors_before == counts["errors"] > count // 2, \
        (cloud.errors_by_code(), codes)
    assert cloud.proc is None or cloud.proc.alive()
    assert legit["sampled"] and all(out == reference for out in legit["sampled"])
    assert legit["greedy"] and all(out == alone for out in legit["greedy"])
    with cloud.generator(tiny_models["draft"], k=FIXED_K, proactive="on") as gen:
        assert gen.generate(PROMPTS[0], **greedy).token_ids == alone  # still serving

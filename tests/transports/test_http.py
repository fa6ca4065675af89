"""The HTTP/JSON transport over real loopback sockets: a uvicorn server on 127.0.0.1 in a
background thread (its own event loop), the edge's own client through
:class:`~spececd.generator.Generator`, and raw HTTP for the JSON sessions and hostile input.

Lossless: greedy ids identical to the target alone, with and without stream drafting, and
after the server restarts mid-generation. Security: bearer auth, TLS, the body limit, a
fuzzer. The JSON shape: create, prefill, verify, close, with the target's KV cache reused.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from spececd.backends.base import (  # noqa: E402
    Backend,
    Extend,
    tokenizer_fingerprint,
)
from spececd.cloud.runners import builtin_service  # noqa: E402
from spececd.cloud.service import CloudService, ServicePolicy  # noqa: E402
from spececd.core.sampling import SparseProbs  # noqa: E402
from spececd.core.stats import GenerationStats  # noqa: E402
from spececd.edge.client import CloudUnreachable, Reconnect  # noqa: E402
from spececd.edge.options import EdgeOptions  # noqa: E402
from spececd.generator import Generator  # noqa: E402
from spececd.protocol import messages as m  # noqa: E402
from spececd.protocol.cloud_session import Limits  # noqa: E402
from spececd.protocol.errors import AuthFailed  # noqa: E402
from spececd.transports.http import HttpTransport  # noqa: E402
from spececd.transports.http import server as http_server  # noqa: E402
from spececd.transports.http.client import unpack_replies  # noqa: E402
from spececd.transports.http.links import FIRST_REPLY, Links  # noqa: E402
from tests.fuzz import mutate  # noqa: E402
from tests.reference import PROMPTS, hf_greedy  # noqa: E402
from tests.support.servers import ThreadServer  # noqa: E402


def error_code(body: bytes) -> str:
    code: str = json.loads(body)["error"]["code"]
    return code


@pytest.fixture(scope="module")
def server(target: Backend) -> Iterator[ThreadServer]:
    proc = ThreadServer(builtin_service(target))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference(tiny_models: dict[str, Path], draft: Backend) -> dict[str, list[int]]:
    """The target's own greedy 40 tokens after each prompt."""
    return {prompt: hf_greedy(tiny_models["llama"], draft.tokenizer.encode(prompt), 40)
            for prompt in PROMPTS}


def edge(draft: Backend, url: str, **kw: Any) -> Generator:
    """The edge's client over :class:`HttpTransport`; ``transport_token``, ``cafile`` and
    ``verify`` go to the transport (``auth_token`` to the session's hello, as the transport
    registry does it)."""
    options = {key: kw.pop(key) for key in ("cafile", "verify") if key in kw}
    if "transport_token" in kw:
        options["auth_token"] = kw.pop("transport_token")
    return Generator(draft, lambda: HttpTransport(url, **options),
                     max_context=draft.max_context, auth_token=kw.pop("auth_token", ""),
                     options=EdgeOptions().with_settings(**kw))


# -- the edge's own protocol -----------------------------------------------------------


@pytest.mark.parametrize("k,proactive", [(4, "off"), ("auto", "on"), (3, "stream")])
def test_greedy_through_the_edge_client_is_identical_to_the_target_alone(
        k: int | str, proactive: str, server: ThreadServer, draft: Backend,
        reference: dict[str, list[int]]) -> None:
    with edge(draft, server.url, k=k, proactive=proactive) as gen:
        for prompt in PROMPTS:
            out = gen.generate(prompt, max_tokens=40, temperature=0, stop_token_ids=[])
            assert out.token_ids == reference[prompt], prompt
            assert out.stats.bytes_sent > 0 and out.stats.bytes_received > 0
            assert out.stats.reconnects == 0
        transport = gen.client.link.transport
        assert isinstance(transport, HttpTransport)
        # Everything went over one kept-alive connection, and the byte counts are the
        # HTTP requests and responses themselves, headers included.
        assert transport._answered >= 5 * 2
        assert transport.bytes_sent > 100 * transport._answered


def test_stream_drafting_hints_are_all_accepted_when_the_draft_is_the_target(
        server: ThreadServer, target: Backend, reference: dict[str, list[int]]) -> None:
    # The target as its own drafter: whatever hints arrive before a step are accepted. How
    # many arrive in time is timing (the benchmark's business); that a hint in time is
    # used is tested deterministically in tests/cloud/test_service.py. The model drafts
    # alone: a lookup's hint may be wrong, and the model's hints after it go with it.
    with edge(target, server.url, k=4, proactive="stream", draft_source="model") as gen:
        out = gen.generate(PROMPTS[0], max_tokens=40, temperature=0, stop_token_ids=[])
    assert out.token_ids == reference[PROMPTS[0]]
    assert out.stats.accepted == out.stats.drafted


def test_cloud_only_generation_long_polls_the_targets_own_tokens(
        server: ThreadServer, draft: Backend, reference: dict[str, list[int]]) -> None:
    with edge(draft, server.url) as gen:
        chunks = list(gen.stream(PROMPTS[4], cloud_only=True, max_tokens=40, temperature=0,
                                 stop_token_ids=[]))
    assert [t for c in chunks for t in c.token_ids] == reference[PROMPTS[4]]
    assert all(c.source == "target" for c in chunks)


def test_idle_links_and_sessions_end_and_the_edge_goes_on(
        target: Backend, draft: Backend, reference: dict[str, list[int]]) -> None:
    proc = ThreadServer(builtin_service(target, policy=ServicePolicy(idle_timeout=0.5)))
    try:
        session = json.loads(proc.request("POST", "/v1/sessions", {})[2])["session_id"]
        with edge(draft, proc.url, k=3) as gen:
            first = gen.generate(PROMPTS[0], max_tokens=40, temperature=0, stop_token_ids=[])
            time.sleep(1.0)  # the link idles out: the next request finds it gone
            second = gen.generate(PROMPTS[1], max_tokens=40, temperature=0,
                                  stop_token_ids=[])
        assert first.token_ids == reference[PROMPTS[0]] and first.stats.reconnects == 0
        assert second.token_ids == reference[PROMPTS[1]] and second.stats.reconnects == 1
        assert proc.engine.status()["evicted_idle"] >= 1
        status, _, body = proc.request("POST", f"/v1/sessions/{session}/prefill",
                                       {"token_ids": [1]})
        assert status == 404 and error_code(body) == "unknown_session"
    finally:
        proc.stop()


def test_a_server_restart_mid_generation_is_resumed_unchanged(
        target: Backend, draft: Backend) -> None:
    first = ThreadServer(builtin_service(target))
    port, second = first.port, None
    try:
        with edge(draft, first.url, k=3, proactive="on",
                  reconnect=Reconnect(attempts=40, delay=0.05, max_delay=0.2)) as gen:
            expected = gen.generate(PROMPTS[1], max_tokens=40, temperature=0.9, seed=5,
                                    stop_token_ids=[]).token_ids
            tokens: list[int] = []
            stats = GenerationStats()
            for i, chunk in enumerate(gen.stream(PROMPTS[1], stats, max_tokens=40,
                                                 temperature=0.9, seed=5, stop_token_ids=[])):
                tokens.extend(chunk.token_ids)
                if i == 2:
                    first.stop()
                    second = ThreadServer(builtin_service(target), port=port)
            assert tokens == expected and stats.reconnects >= 1
    finally:
        (second or first).stop()


def test_an_ended_link_is_reopened_and_the_output_is_unchanged(
        server: ThreadServer, draft: Backend, reference: dict[str, list[int]]) -> None:
    with edge(draft, server.url, k=3) as gen:
        tokens: list[int] = []
        stats = GenerationStats()
        for i, chunk in enumerate(gen.stream(PROMPTS[2], stats, max_tokens=40, temperature=0,
                                             stop_token_ids=[])):
            tokens.extend(chunk.token_ids)
            transport = gen.client.link.transport
            assert isinstance(transport, HttpTransport) and transport._link is not None
            if i == 2:
                status, _, _ = server.request("DELETE", transport._link)
                assert status == 204  # the server forgot the link: the next POST gets 404
            if i == 4:  # the connection breaks under the link, which goes on
                link = transport._link
                assert transport._conn is not None
                transport._conn.sock.close()
        assert tokens == reference[PROMPTS[2]]
        assert stats.reconnects == 1  # for the deleted link only
        assert gen.client.link.transport is transport and transport._link == link


def test_a_connection_the_server_closed_while_idle_is_replaced_unnoticed(
        monkeypatch: pytest.MonkeyPatch, target: Backend, draft: Backend,
        reference: dict[str, list[int]]) -> None:
    monkeypatch.setattr(http_server, "KEEP_ALIVE", 1)
    proc = ThreadServer(builtin_service(target))
    try:
        with edge(draft, proc.url, k=3) as gen:
            connections, links = [], []
            for prompt in PROMPTS[:2]:
                out = gen.generate(prompt, max_tokens=40, temperature=0, stop_token_ids=[])
                assert out.token_ids == reference[prompt] and out.stats.reconnects == 0
                transport = gen.client.link.transport
                assert isinstance(transport, HttpTransport)
                connections.append(transport._conn)
                links.append(transport._link)
                time.sleep(1.6)  # the server closes the kept-alive connection meanwhile
            # The second generation found the connection closed and went on, on a new
            # connection, with the same link.
            assert connections[0] is not connections[1] and links[0] == links[1]
    finally:
        proc.stop()


def test_frames_are_numbered_and_replies_acknowledged(server: ThreadServer,
                                                      target: Backend) -> None:
    status, _, body = server.request("POST", "/v1/links", b"")
    assert status == 201
    link = f"/v1/links/{json.loads(body)['link_id']}"
    fingerprint = tokenizer_fingerprint(target.tokenizer, target.vocab_size)
    hello = m.encode(m.Hello(m.PROTOCOL_VERSION, fingerprint, "match", 0, 0, 1.0, 1))
    status, headers, body = server.request("POST", f"{link}/frames?n=0&ack=0&wait=10", hello)
    assert status == 200 and headers[FIRST_REPLY.lower()] == "0"
    (welcome,) = unpack_replies(body)
    assert isinstance(m.decode(welcome), m.Welcome)
    # The same frame again (a retry): answered with the same reply, not applied twice.
    status, headers, body = server.request("POST", f"{link}/frames?n=0&ack=0&wait=0", hello)
    assert (status, headers[FIRST_REPLY.lower()], unpack_replies(body)) == (200, "0", [welcome])
    draft_frame = m.encode(m.Draft(1, 0, (5, 6, 7), (8,)))
    status, _, body = server.request("POST", f"{link}/frames?n=2&ack=1", draft_frame)
    assert status == 409 and error_code(body) == "out_of_order"  # frame 1 is missing
    status, headers, body = server.request("POST", f"{link}/frames?n=1&ack=1&wait=10",
                                           draft_frame)
    assert status == 200 and headers[FIRST_REPLY.lower()] == "1"
    assert [type(m.decode(r)) for r in unpack_replies(body)] == [m.Verdict]
    status, _, body = server.request("GET", f"{link}/frames?ack=2&wait=0")
    assert status == 200 and body == b""
    assert server.request("DELETE", link)[0] == 204
    # A link deleted as soon as it is opened, before its task ran, is released too.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    for _ in range(5):
        conn.request("POST", "/v1/links", b"")
        other = json.loads(conn.getresponse().read())["link_id"]
        conn.request("DELETE", f"/v1/links/{other}")
        assert conn.getresponse().read() == b""
    conn.close()
    deadline = time.monotonic() + 5
    while server.engine.status()["sessions"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.engine.status()["sessions"] == 0
    for method in ("GET", "DELETE"):
        status, _, body = server.request(method, f"{link}/frames" if method == "GET" else link)
        assert status == 404 and error_code(body) == "unknown_session"


def test_a_link_closed_before_its_task_ran_is_released(target: Backend) -> None:
    engine = builtin_service(target)

    async def main() -> int:
        links = Links(engine)
        links.close(links.open())  # in one turn of the loop: its task has not started
        await asyncio.sleep(0.05)
        return len(engine.links)

    assert asyncio.run(main()) == 0
    engine.close()


# -- the JSON sessions --------------------------------------------------------------------


class FedTokens:
    """A backend that records how many tokens each target pass was fed."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.fed: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def extend_batch(self, items: Sequence[Extend]) -> list[Any]:
        self.fed.extend(len(item.ids) for item in items)
        return self._backend.extend_batch(items)  # type: ignore[attr-defined, no-any-return]


def verify_latency(engine: CloudService) -> tuple[float, float]:
    """The verification passes the engine has timed: how many, and their seconds."""
    registry = engine.metrics.registry
    count = registry.get_sample_value("spececd_verify_latency_seconds_count")
    total = registry.get_sample_value("spececd_verify_latency_seconds_sum")
    return count or 0.0, total or 0.0


def test_json_sessions_verify_like_the_target_and_reuse_its_kv_cache(
        target: Backend, tiny_models: dict[str, Path]) -> None:
    backend = FedTokens(target)
    proc = ThreadServer(builtin_service(backend))  # type: ignore[arg-type]
    try:
        prompt = target.tokenizer.encode(PROMPTS[0])
        expected = hf_greedy(tiny_models["llama"], prompt, 12)
        status, _, body = proc.request("POST", "/v1/sessions", {"strategy": "greedy"})
        assert status == 201
        created = json.loads(body)
        assert created["mode"] == "greedy" and created["max_draft"] > 0
        session = f"/v1/sessions/{created['session_id']}"
        status, _, body = proc.request("POST", f"{session}/prefill", {"token_ids": prompt})
        assert (status, json.loads(body)) == (200, {"total_tokens": len(prompt)})
        assert backend.fed == [len(prompt)]  # the prompt went through the target once
        # Four right tokens: all kept, and the target's bonus is the fifth.
        passes_before, seconds_before = verify_latency(proc.engine)
        status, _, body = proc.request("POST", f"{session}/verify",
                                       {"draft_tokens": expected[:4]})
        verdict = json.loads(body)
        assert status == 200, verdict
        assert verdict["accepted_prefix_len"] == 4 and verdict["preds"] == expected[:5]
        assert verdict["next_token"] == expected[4]
        assert verdict["total_tokens"] == len(prompt) + 5
        # verify_ms is the one target pass this verify ran, as the engine timed it (not
        # the request's wall time, not seconds, not a zero the adapter left unfilled), to
        # the wire's resolution (a verdict carries its time in ticks).
        passes, seconds = verify_latency(proc.engine)
        assert passes == passes_before + 1
        assert verdict["verify_ms"] == pytest.approx((seconds - seconds_before) * 1000,
                                                     abs=m.TICK * 1000 / 2 + 1e-6)
        # A wrong second token: the first kept, the target's own correction after it.
        wrong = (expected[6] + 1) % target.vocab_size
        status, _, body = proc.request("POST", f"{session}/verify",
                                       {"draft_tokens": [expected[5], wrong, expected[7]]})
        verdict = json.loads(body)
        assert (verdict["accepted_prefix_len"], verdict["preds"]) == (1, expected[5:7])
        # Each verify fed the target only what it did not hold: the last token it had
        # not run yet, and the draft; never the history again.
        assert backend.fed[1:] == [1 + 4, 1 + 3]
        assert proc.engine.status()["kv_tokens"] >= len(prompt) + 5
        status, _, body = proc.request("POST", f"{session}/verify", {"draft_tokens": []})
        assert json.loads(body)["preds"] == expected[7:8]  # an empty draft: one token
        assert proc.request("DELETE", session)[0] == 204
        status, _, body = proc.request("POST", f"{session}/verify", {"draft_tokens": [1]})
        assert status == 404 and error_code(body) == "unknown_session"
        deadline = time.monotonic() + 5
        while proc.engine.status()["sessions"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.engine.status()["sessions"] == 0  # the engine link closed too
    finally:
        proc.stop()


def test_exact_mode_needs_the_sparse_draft_distribution(server: ThreadServer,
                                                       target: Backend) -> None:
    status, _, body = server.request("POST", "/v1/sessions", {
        "mode": "exact", "temperature": 1.0, "top_k": 20, "seed": 3})
    session = f"/v1/sessions/{json.loads(body)['session_id']}"
    assert server.request("POST", f"{session}/prefill", {"token_ids": [5, 6, 7]})[0] == 200
    status, _, body = server.request("POST", f"{session}/verify", {"draft_tokens": [8, 9]})
    assert status == 400 and error_code(body) == "invalid_probabilities"
    assert "draft_probs" in json.loads(body)["error"]["message"]
    half = {"ids": [8, 9], "probs": [0.5, 0.5]}
    status, _, body = server.request("POST", f"{session}/verify",
                                     {"draft_tokens": [8, 9], "draft_probs": [half]})
    assert status == 400 and error_code(body) == "invalid_probabilities"  # one for two
    status, _, body = server.request("POST", f"{session}/verify", {
        "draft_tokens": [8, 9], "draft_probs": [half, {"ids": [9], "probs": [1.0]}]})
    assert status == 200, body
    assert json.loads(body)["total_tokens"] == 3 + json.loads(body)["accepted_prefix_len"] + 1
    status, _, body = server.request("POST", f"{session}/verify", {
        "draft_tokens": [8], "draft_probs": [{"ids": [8], "probs": [0.3]}]})
    assert status == 400 and error_code(body) == "invalid_probabilities"  # sums to 0.3
    outside = target.vocab_size + 3
    status, _, body = server.request("POST", f"{session}/verify", {
        "draft_tokens": [outside], "draft_probs": [{"ids": [outside], "probs": [1.0]}]})
    assert status == 400 and error_code(body) == "invalid_tokens"
    status, _, body = server.request("POST", f"{session}/verify", {
        "draft_tokens": [1] * 99, "draft_probs": [{"ids": [1], "probs": [1.0]}] * 99})
    assert status == 413 and error_code(body) == "limit_exceeded"  # over max_draft
    status, _, body = server.request("POST", "/v1/sessions", {})
    new = f"/v1/sessions/{json.loads(body)['session_id']}"
    status, _, body = server.request("POST", f"{new}/verify", {"draft_tokens": [1]})
    assert status == 409 and error_code(body) == "out_of_order"  # nothing prefilled
    for session_path in (session, new):
        server.request("DELETE", session_path)


# -- security, limits, operations ------------------------------------------------------


def test_bearer_auth_is_enforced_on_every_v1_endpoint(target: Backend, draft: Backend) -> None:
    proc = ThreadServer(builtin_service(target, auth_token="s3cret"))
    try:
        for method, path, body in (("POST", "/v1/links", b""), ("POST", "/v1/sessions", {}),
                                   ("POST", "/v1/links/x/frames", b"\x90"),
                                   ("GET", "/v1/links/x/frames", None),
                                   ("DELETE", "/v1/sessions/x", None)):
            for headers in ({}, {"Authorization": "Bearer wrong"},
                            {"Authorization": "Basic czNjcmV0"}):
                status, answer, data = proc.request(method, path, body, headers)
                assert status == 401 and error_code(data) == "auth_failed", (method, path)
                assert answer["www-authenticate"] == "Bearer"
        assert proc.request("POST", "/v1/sessions", {},
                            {"Authorization": "Bearer s3cret"})[0] == 201
        assert proc.request("GET", "/healthz")[0] == 200  # operations need no token
        for wrong in ({}, {"auth_token": "wrong"}, {"transport_token": "wrong",
                                                    "auth_token": "s3cret"}):
            with edge(draft, proc.url, k=3, reconnect=Reconnect(attempts=0), **wrong) as gen, \
                    pytest.raises(AuthFailed):
                gen.generate("x", max_tokens=3)
        # The token in the hello authorizes the link (the transport registry gives the
        # transport no token), or the transport's own.
        for right in ({"auth_token": "s3cret"}, {"transport_token": "s3cret",
                                                 "auth_token": "s3cret"}):
            with edge(draft, proc.url, k=3, **right) as gen:
                assert len(gen.generate("x", max_tokens=5, temperature=0).token_ids) == 5
        assert proc.engine.metrics.registry.get_sample_value(
            "spececd_errors_total", {"code": "auth_failed"}) == 15 + 3
    finally:
        proc.stop()


def test_https_with_a_self_signed_certificate(tmp_path: Path, target: Backend,
                                             draft: Backend) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    proc = ThreadServer(builtin_service(target), tls=(str(cert), str(key)))  # as the registry does
    try:
        assert proc.url.startswith("https://")
        with edge(draft, proc.url, k=3, proactive="stream", cafile=str(cert)) as gen:
            assert len(gen.generate("x", max_tokens=6, temperature=0).token_ids) == 6
        with edge(draft, proc.url, k=3, verify=False) as gen:
            assert len(gen.generate("x", max_tokens=3, temperature=0).token_ids) == 3
        untrusted = edge(draft, proc.url, reconnect=Reconnect(attempts=0))
        with pytest.raises(CloudUnreachable):
            untrusted.generate("x", max_tokens=3)
        plain = edge(draft, proc.url.replace("https", "http"), reconnect=Reconnect(attempts=0))
        with pytest.raises(CloudUnreachable):
            plain.generate("x", max_tokens=3)
    finally:
        proc.stop()


def test_a_body_over_the_limit_is_refused_with_413(target: Backend) -> None:
    proc = ThreadServer(builtin_service(target, Limits(max_message_bytes=2000)))
    try:
        link = f"/v1/links/{json.loads(proc.request('POST', '/v1/links', b'')[2])['link_id']}"
        session = json.loads(proc.request("POST", "/v1/sessions", {})[2])["session_id"]
        for path, body in ((f"{link}/frames", b"\x00" * 2001),
                           (f"/v1/sessions/{session}/prefill",
                            json.dumps({"token_ids": [1] * 1000}).encode())):
            status, _, data = proc.request("POST", path, body,
                                           {"Content-Type": "application/json"})
            assert status == 413 and error_code(data) == "limit_exceeded", path
        # A body that does not say its length is cut off once it is over the limit.
        conn = http.client.HTTPConnection("127.0.0.1", proc.port, timeout=10)
        conn.request("POST", f"{link}/frames", iter([b"\x00" * 1500] * 3),
                     encode_chunked=True)
        response = conn.getresponse()
        assert response.status == 413 and error_code(response.read()) == "limit_exceeded"
        conn.close()
        # The link is still usable: the refused bodies never reached it.
        status, _, data = proc.request("POST", f"{link}/frames?wait=5", b"\xc1")
        (reply,) = unpack_replies(data)
        assert status == 200 and m.decode(reply) == m.Error(
            "malformed_frame", m.decode(reply).message, -1, False)  # type: ignore[union-attr]
    finally:
        proc.stop()


def test_operations_and_the_openapi_schema_on_the_same_port(target: Backend) -> None:
    proc = ThreadServer(builtin_service(target, policy=ServicePolicy(max_sessions=1)))
    try:
        assert proc.request("GET", "/healthz")[::2] == (200, b"ok\n")
        assert proc.request("GET", "/readyz")[::2] == (200, b"ready\n")
        link = json.loads(proc.request("POST", "/v1/links", b"")[2])["link_id"]
        assert proc.request("GET", "/readyz")[::2] == (503, b"full\n")
        status, _, body = proc.request("POST", "/v1/links", b"")
        assert status == 503 and error_code(body) == "server_busy"
        status, _, body = proc.request("POST", "/v1/sessions", {})
        assert status == 503 and error_code(body) == "server_busy"
        status, headers, body = proc.request("GET", "/status")
        assert status == 200 and json.loads(body)["sessions"] == 1
        status, headers, body = proc.request("GET", "/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain")
        assert b"spececd_active_sessions 1.0" in body
        assert b'spececd_errors_total{code="server_busy"} 2.0' in body
        proc.request("DELETE", f"/v1/links/{link}")
        status, _, body = proc.request("GET", "/openapi.json")
        schema = json.loads(body)
        assert status == 200 and set(schema["paths"]) == {
            "/v1/links", "/v1/links/{link_id}", "/v1/links/{link_id}/frames", "/v1/sessions",
            "/v1/sessions/{session_id}", "/v1/sessions/{session_id}/prefill",
            "/v1/sessions/{session_id}/verify", "/healthz", "/readyz", "/status", "/metrics",
            "/v1/tokenizer", "/v1/tokenizer/fingerprint"}
        verify = schema["paths"]["/v1/sessions/{session_id}/verify"]["post"]
        assert verify["requestBody"]["content"]["application/json"]["schema"]["$ref"] \
            .endswith("/VerifyBody")
        assert verify["responses"]["200"]["content"]["application/json"]["schema"]["$ref"] \
            .endswith("/Verified")
        assert {"400", "401", "404", "409", "413", "500", "503"} <= set(verify["responses"])
        assert "422" not in verify["responses"]
        frames = schema["paths"]["/v1/links/{link_id}/frames"]["post"]
        assert "application/octet-stream" in frames["requestBody"]["content"]
        assert {p["name"] for p in frames["parameters"]} == {"link_id", "n", "ack", "wait"}
        assert set(schema["components"]["schemas"]["Verified"]["properties"]) == {
            "accepted_prefix_len", "preds", "next_token", "total_tokens", "verify_ms"}
        assert proc.request("GET", "/docs")[0] == 200
        status, _, body = proc.request("GET", "/v1/nowhere")
        assert status == 404 and error_code(body) == "protocol_error"
    finally:
        proc.stop()


# -- hostile input ---------------------------------------------------------------------


JUNK: list[Any] = [0, -1, 2**40, 1.5, float("nan"), float("inf"), "x", "exact", None, True,
                   [], [1, 2], [-5, 10**6], b"\x00" * 8, {"a": 1}]  # msgpack can pack these
JSON_JUNK = [*JUNK[:-2], 2**70, [2**33], {"ids": [1], "probs": [1.0]},
             [{"ids": [1, 2], "probs": [0.5, 0.5]}], [{"ids": [1], "probs": ["x"]}]]


def junk_json(rng: random.Random, keys: Sequence[str]) -> bytes:
    if rng.random() < 0.3:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
    body = {rng.choice(keys): rng.choice(JSON_JUNK) for _ in range(rng.randint(0, 3))}
    text = json.dumps(body)
    return mutate(text.encode(), rng) if rng.random() < 0.5 else text.encode()


def test_fuzzing_a_live_server_leaves_a_legitimate_session_unchanged(
        server: ThreadServer, draft: Backend, target: Backend) -> None:
    with edge(draft, server.url, k=3, proactive="stream") as gen:
        expected = gen.generate(PROMPTS[3], max_tokens=60, temperature=0.8, seed=3,
                                stop_token_ids=[]).token_ids
    legit: list[list[int]] = []
    fuzzing = threading.Event()
    fuzzing.set()

    def legitimate() -> None:  # one session, generating again until the fuzzing is over
        with edge(draft, server.url, k=3, proactive="stream") as g:
            while fuzzing.is_set() or not legit:
                legit.append(g.generate(PROMPTS[3], max_tokens=60, temperature=0.8, seed=3,
                                        stop_token_ids=[]).token_ids)

    thread = threading.Thread(target=legitimate)
    thread.start()
    rng = random.Random(0)
    fingerprint = tokenizer_fingerprint(target.tokenizer, target.vocab_size)
    hello = m.encode(m.Hello(m.PROTOCOL_VERSION, fingerprint, "exact", 1.0, 0, 1.0, 1))
    one = SparseProbs(np.array([7]), np.array([1.0], dtype=np.float32))
    seeds = [hello, m.encode(m.Draft(1, 0, (5, 6), (7, 8), None)),
             m.encode(m.Draft(2, 0, (5,), (7,), (one,))), m.encode(m.Hint(3, (1, 2))),
             m.encode(m.Generate(3, 0, (5,), 3)), m.encode(m.Close("x"))]
    counts = {"frames": 0, "json": 0}
    statuses: dict[int, int] = {}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)

    def call(method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        json_type = {"Content-Type": "application/json"} if "sessions" in path else {}
        conn.request(method, path, body, json_type)
        response = conn.getresponse()
        data = response.read()
        statuses[response.status] = statuses.get(response.status, 0) + 1
        assert response.status < 500 or response.status == 503, (path, body, data)
        if response.status >= 400:
            assert error_code(data), data  # every refusal is a typed error
        return response.status, data

    link = ""
    sessions = []
    for _ in range(4):
        _, data = call("POST", "/v1/sessions", json.dumps({"seed": 1}).encode())
        sessions.append(f"/v1/sessions/{json.loads(data)['session_id']}")
        call("POST", f"{sessions[-1]}/prefill", b'{"token_ids": [5, 6, 7]}')
    while counts["frames"] + counts["json"] < 2400:
        if not link or rng.random() < 0.01:
            status, data = call("POST", "/v1/links", b"")
            link = f"/v1/links/{json.loads(data)['link_id']}" if status == 201 else ""
            if link and rng.random() < 0.5:
                call("POST", f"{link}/frames?wait=5", hello)
            continue
        if rng.random() < 0.5:
            kind = rng.random()
            frame = (bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))) if kind < 0.3
                     else msgpack.packb([rng.randint(0, 10), *(rng.choice(JUNK)
                                                            for _ in range(rng.randint(0, 7)))])
                     if kind < 0.6 else mutate(rng.choice(seeds), rng))
            query = rng.choice(["?wait=0.05", "?n=0&wait=0.05", "?ack=999", "?wait=-1",
                                "?wait=x", "?n=-3", ""])
            status, data = call("POST", f"{link}/frames{query}", frame)
            counts["frames"] += 1
            if status == 200:
                replies = [m.decode(r) for r in unpack_replies(data)]
                if any(isinstance(r, m.Error) and r.fatal for r in replies):
                    link = ""
            elif status == 404:
                link = ""
        else:
            session = rng.choice(sessions)
            path, keys = rng.choice([
                (f"{session}/verify", ["draft_tokens", "draft_probs", "x"]),
                (f"{session}/prefill", ["token_ids", "y"]),
                ("/v1/sessions", ["mode", "strategy", "temperature", "top_k", "top_p",
                                  "seed", "z"])])
            status, data = call("POST", path, junk_json(rng, keys))
            counts["json"] += 1
            if path == "/v1/sessions" and status == 201:
                call("DELETE", f"/v1/sessions/{json.loads(data)['session_id']}")
    conn.close()
    fuzzing.clear()
    thread.join(timeout=120)
    print(f"fuzz: {counts}, statuses {dict(sorted(statuses.items()))}, "
          f"{len(legit)} legitimate generations meanwhile")
    assert counts["frames"] >= 1000 and counts["json"] >= 1000
    assert statuses[400] > 500 and statuses[200] > 500
    assert len(legit) > 1 and all(tokens == expected for tokens in legit)
    assert server.request("GET", "/healthz")[0] == 200

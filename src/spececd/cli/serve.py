"""``spececd serve``: the verifier server, the cloud side.

:func:`serve` is the wiring, in one place: the target backend, the engine with its limits
and policy, and the listeners (WebSocket, gRPC, HTTP) in front of it.

It fails loudly: the engine generates two tokens before the server says it is serving (an
engine that cannot exits with status 1 and the cause), and an engine that fails later
makes the server drain and exit with status 1, for a supervisor to restart it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from typing import Any

from spececd import config, processes
from spececd.cli.options import add_model_options, default_model, spare_cores
from spececd.config import ServerConfig
from spececd.errors import InputError
from spececd.protocol.errors import EngineFailed

DEFAULTS = ServerConfig()


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the verifier server (the cloud side)")
    add_model_options(p, draft=False)
    d = DEFAULTS
    e = p.add_argument_group("engine")
    e.add_argument("--engine", choices=["builtin", "vllm"],
                   help="what runs the target: the built-in engine (transformers or "
                   "llama.cpp, batched here) or vLLM's engine in this process (install it "
                   f"with scripts/install-vllm.sh) (default: {d.engine})")
    e.add_argument("--static", choices=["auto", "on", "off"],
                   help="built-in engine, transformers target: run its packed, paged "
                   "passes in a few fixed shapes, replayed from CUDA graphs on a GPU (auto: "
                   "on CUDA only; on a CPU they only add padding) "
                   f"(default: {d.static})")
    e.add_argument("--tensor-parallel-size", type=int,
                   help="vLLM: split the target over this many devices (default: 1)")
    e.add_argument("--engine-args", help="vLLM: further engine arguments as a JSON object, "
                   "e.g. '{\"gpu_memory_utilization\": 0.8}' (vLLM's AsyncEngineArgs)")
    g = p.add_argument_group("server")
    g.add_argument("--host", help=f"address to listen on (default: {d.host})")
    g.add_argument("--port", type=int, help=f"WebSocket port, -1 for none (default: {d.port})")
    g.add_argument("--grpc-port", type=int, help="also serve gRPC on this port (0: any free "
                   "port; default: -1 = no gRPC)")
    g.add_argument("--http-port", type=int, help="also serve HTTP/JSON sessions on this port, "
                   "with /metrics and the OpenAPI schema (0: any free port; default: -1 = no "
                   "HTTP)")
    g.add_argument("--max-sessions", type=int,
                   help=f"concurrent sessions at most (default: {d.max_sessions})")
    g.add_argument("--max-context", type=int, help="context tokens per session at most "
                   f"(default: {d.max_context}, and the model's own)")
    g.add_argument("--max-draft", type=int,
                   help=f"drafted tokens per round at most (default: {d.max_draft})")
    g.add_argument("--pass-width", type=int, help="the longest draft told to edges as this "
                   "server's pass width, how far past 8 they send drafts that cost nothing "
                   "to draft (a lookup, a prediction) in one round (default: 0 = the "
                   "engine's: the built-in verifies --max-draft in one pass, vLLM 16 a step)")
    g.add_argument("--max-message-bytes", type=int,
                   help=f"largest frame accepted (default: {d.max_message_bytes})")
    g.add_argument("--max-batch", type=int, help="sessions verified in one forward pass at most "
                   f"(default: {d.max_batch})")
    g.add_argument("--max-kv-bytes", type=int, help="KV cache bytes across sessions at most; "
                   "the least recently used idle sessions' caches are freed and rebuilt on "
                   "their next round (default: 0 = no cap)")
    g.add_argument("--token-budget", help="built-in engine: positions (context and drafted "
                   "tokens) one pass computes at most: auto (learned from what passes cost, "
                   "within --pass-latency-ms), off (everything queued in one pass) or a "
                   "number; sessions decoding get their token first, drafts are cut to what "
                   "their positions are worth, prompts are prefilled in chunks in the rest "
                   f"(default: {d.token_budget})")
    g.add_argument("--pass-latency-ms", type=float, help="the latency aim of one pass that "
                   f"bounds --token-budget auto (default: {d.pass_latency_ms:g})")
    g.add_argument("--max-batched-tokens", type=int, help="built-in engine: positions one "
                   "pass computes at most whatever the budget, a bound from memory (vLLM's "
                   "max_num_batched_tokens): prompts past it are prefilled in chunks "
                   f"(default: {d.max_batched_tokens}; 0: no cap)")
    g.add_argument("--idle-timeout", type=float, help="seconds of silence before a session is "
                   f"evicted (default: {d.idle_timeout})")
    g.add_argument("--request-timeout", type=float, help="seconds a client has to send a "
                   "whole HTTP request or WebSocket handshake; a slower one is answered 408 "
                   f"(HTTP) or disconnected (default: {d.request_timeout:g})")
    g.add_argument("--drain-timeout", type=float, help="on SIGTERM: refuse new sessions and "
                   "rounds with a `draining` error (edges reconnect elsewhere at once), mark "
                   "/readyz not ready, let passes under way finish, and exit within this many "
                   f"seconds (default: {d.drain_timeout:g})")
    g.add_argument("--auth-token-file", help="require this bearer token (file's first line; "
                   "default: $SPECECD_AUTH_TOKEN if set, else no auth)")
    g.add_argument("--tls-cert", help="TLS certificate (PEM): serve wss://")
    g.add_argument("--tls-key", help="TLS private key (PEM)")
    g.add_argument("--web-draft", help="the draft that the browser edge's page, served at / "
                   "on the WebSocket port, may download and draft with: a transformers "
                   "folder (e.g. models/draft; exported once to fp32 ONNX, the fastest form "
                   "in a browser, and cached) or an ONNX Runtime GenAI folder, served as it "
                   "is (default: none; the page drafts by lookup)")
    g.add_argument("--allowed-origin", dest="allowed_origins", action="append",
                   metavar="ORIGIN", help="a web page's origin (e.g. https://app.example, or "
                   "http://gpu-box:8765 for this server's own page under a host name) that "
                   "may open WebSocket sessions; repeat for more, * for any. The page this "
                   "server serves is let in where the browser reached it by localhost or an "
                   "IP address; other origins are refused (403), so that no site a user "
                   "visits can drive a server on their machine (default: none)")
    g.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="logs on stderr as text or as JSON lines (with session ids)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    cfg = config.load(ServerConfig, args.config,
                      {k: v for k, v in vars(args).items() if v is not None})
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise InputError("TLS needs both --tls-cert and --tls-key")
    cfg.runner().budget()  # a bad --token-budget says so before any model loads
    # vLLM's engine processes, and any other, end with the server at every stage
    with processes.ended_with_this_one():
        return serve(cfg, config.auth_token(cfg.auth_token_file))


def serve(cfg: ServerConfig, token: str) -> int:
    """Load the target and serve it on every listener asked for until interrupted."""
    from spececd.backends.registry import model_format
    from spececd.cloud import runners
    from spececd.transports import registry
    from spececd.transports.web import WebEdge

    listeners = [registry.Listener(name, cfg.host, port, cfg.request_timeout, cfg.allowed_origins)
                 for name, port in
                 (("websocket", cfg.port), ("grpc", cfg.grpc_port), ("http", cfg.http_port))
                 if port >= 0]
    if not listeners:
        raise InputError("no transport to serve: give --port, --grpc-port or --http-port")
    web = WebEdge.checked(cfg.web_draft)
    model = cfg.target_model or default_model("target")
    # All cores but one unless --threads says (transformers, built-in runner): an edge on
    # this machine, and the server's own event loop, keep one, where idle OpenMP workers
    # would spin.
    threads = cfg.threads or (spare_cores() if cfg.engine == "builtin"
                              and model_format(model) == "hf" else 0)
    engine = runners.service(cfg.engine, model, cfg.runner(threads), cfg.limits(),
                             cfg.policy(), token)

    def ready(urls: list[str]) -> None:
        print(f"spececd: serving {engine.target.description} on {', '.join(urls)}"
              f"{' (auth required)' if token else ''}", file=sys.stderr, flush=True)

    async def main() -> None:
        # One short generation before "serving": an engine that loads a model it cannot
        # run fails here, with the cause, rather than on the first edge's request.
        await engine.check()
        serving = asyncio.ensure_future(registry.serve(
            engine, listeners, (cfg.tls_cert, cfg.tls_key) if cfg.tls_cert else None, ready,
            web))

        async def drain(why: str) -> None:
            try:
                with contextlib.suppress(OSError):  # stderr may be gone (its reader left)
                    print(f"spececd: draining ({why})", file=sys.stderr, flush=True)
                await engine.drain(cfg.drain_timeout)
            finally:  # whatever happens, SIGTERM ends the server
                serving.cancel()

        async def on_failure() -> None:
            # A request that fails on a dead runner fails the service at once; a runner
            # that dies while idle is noticed by its health check here.
            while not engine.failed.is_set():
                if not engine.alive():
                    engine.fail("the engine stopped (its health check failed)")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(engine.failed.wait(), 1.0)
            await drain(f"the engine failed: {engine.failure}")

        watch = asyncio.ensure_future(on_failure())
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM,
                                lambda: asyncio.ensure_future(drain("SIGTERM")))
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await serving
        finally:
            watch.cancel()

    try:
        asyncio.run(main())
    except OSError as exc:
        raise InputError(f"cannot listen on {cfg.host}: {exc.strerror}") from None
    finally:
        processes.exit_on_signals()  # asyncio.run gave SIGTERM back to its default action
        engine.close()
    if engine.failure:  # non-zero, so that a supervisor restarts the server
        raise EngineFailed(f"the {engine.name} engine failed ({engine.failure}); the "
                           f"server drained and exits for its supervisor to restart it")
    return 0

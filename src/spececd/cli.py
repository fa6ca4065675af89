"""The ``spececd`` command line. It owns the terminal: library code only logs.

    spececd demo                     the default pair, in-process, on built-in prompts
    spececd generate ...             one prompt, streamed or as JSON (--json); in-process,
                                     or against a server with --server ws://HOST:PORT
    spececd chat --server ...        an interactive chat, streaming the replies
    spececd serve ...                the verifier server (the cloud side)
    spececd devices                  the devices this machine can run models on

Errors a user can cause print one line, ``spececd: error: ...``, and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from spececd import config
from spececd.config import EdgeConfig, ServerConfig
from spececd.core.stats import GenerationStats
from spececd.edge.options import parse_k
from spececd.errors import InputError, SpecECDError
from spececd.protocol.errors import AuthFailed, IncompatibleModels, VersionMismatch

log = logging.getLogger("spececd")

USER_ERRORS = (InputError, IncompatibleModels, AuthFailed, VersionMismatch)
COLOURS = {"draft": "\033[32m", "target": "\033[1;33m", "fallback": "\033[2;31m"}
RESET = "\033[0m"


def models_dir() -> Path:
    """Where the default pair lives: $SPECECD_MODELS, else the repository's models/."""
    env = os.environ.get("SPECECD_MODELS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "models"


def default_model(kind: str) -> str:
    path = models_dir() / kind
    if not (path / "config.json").is_file():
        raise InputError(f"the default {kind} model is not at {path}: run from a clone of the "
                         f"repository, set SPECECD_MODELS, or pass --{kind}-model")
    return str(path)


def demo_prompts() -> list[str]:
    path = models_dir() / "heldout_prompts.json"
    if not path.is_file():
        raise InputError(f"no built-in prompts at {path}: set SPECECD_MODELS to the models/ "
                         f"folder of a clone of the repository")
    return list(json.loads(path.read_text()))


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def add_model_options(p: argparse.ArgumentParser, cls: type = EdgeConfig,
                      draft: bool = True) -> None:
    g = p.add_argument_group("models")
    if draft:
        g.add_argument("--draft-model", help="draft model: local folder or hub id "
                       "(default: the project's trained draft)")
    g.add_argument("--target-model", help="target model: local folder or hub id "
                   "(default: the project's trained target)")
    g.add_argument("--device", help="auto, cpu, cuda, cuda:N or mps (default: auto)")
    g.add_argument("--dtype", help="auto, float32, float16 or bfloat16 "
                   "(default: auto = float32 on cpu, bfloat16 on GPUs)")
    g.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--config", type=Path, help="config.toml to read settings from; flags and "
                   "SPECECD_* environment variables override it")


def add_sampling_options(p: argparse.ArgumentParser, temperature: float,
                         max_tokens: int = 128) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int,
                   help=f"tokens to generate at most (default: {max_tokens})")
    g.add_argument("--temperature", type=float, help=f"0 = greedy (default: {temperature})")
    g.add_argument("--top-k", type=int, help="keep the k most likely tokens (default: 0 = off)")
    g.add_argument("--top-p", type=float, help="nucleus sampling mass (default: 1 = off)")
    g.add_argument("--seed", type=int, default=None, help="seed for a reproducible run")
    g.add_argument("--k", help="drafted tokens per round, or auto: chosen each round from "
                   "measured acceptance, draft, verify and network costs (default: auto)")
    g.add_argument("--proactive", choices=["auto", "on", "off", "stream"],
                   help="on: draft the next block while a verdict is in flight; stream: the "
                   "server generates without waiting for drafts and the edge streams drafts "
                   "ahead of it (fastest on a slow link; --server only); default: auto = on "
                   "with --server, off in-process")
    g.add_argument("--mode", choices=["exact", "match", "greedy"],
                   help="verification: exact (Leviathan et al., default), match (token ids "
                   "only), greedy (temperature 0)")
    g.add_argument("--max-support", type=int,
                   help="exact mode: draft distribution cut to this many tokens (default: 64)")


def add_network_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("network (edge + cloud)")
    g.add_argument("--server", help="verifier URL, ws://HOST:PORT or wss://HOST:PORT; without "
                   "it the target runs in this process")
    g.add_argument("--auth-token-file", help="file holding the bearer token "
                   "(default: $SPECECD_AUTH_TOKEN)")
    g.add_argument("--tls-ca", help="CA certificate to verify a wss:// server with")
    g.add_argument("--insecure", dest="tls_verify", action="store_const", const=False,
                   help="do not verify the server's TLS certificate")
    g.add_argument("--reconnect-attempts", type=int,
                   help="reconnections tried when the link fails (default: 5)")
    g.add_argument("--reconnect-delay", type=float,
                   help="seconds before the first reconnection, doubled each time "
                   "(default: 0.25)")
    g.add_argument("--fallback", choices=["none", "draft"],
                   help="when the verifier is unreachable: none = fail (default), draft = "
                   "finish with the draft model alone, marked as such")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spececd", description="Lossless speculative decoding: a small draft model "
        "proposes, a large target model verifies.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the default pair in-process on built-in prompts")
    add_model_options(demo)
    add_sampling_options(demo, temperature=0.0, max_tokens=64)
    demo.add_argument("--num-prompts", type=int, default=3, help="built-in prompts to run")
    demo.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    demo.set_defaults(demo_defaults={"temperature": 0.0, "max_tokens": 64})

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="file holding the prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    add_model_options(gen)
    add_sampling_options(gen, temperature=1.0)
    add_network_options(gen)
    gen.add_argument("--n", type=int, default=1, help="independent completions to draw")
    gen.add_argument("--json", action="store_true", help="print one JSON object, no streaming")
    gen.add_argument("--color", choices=["auto", "always", "never"], default="auto")

    chat = sub.add_parser("chat", help="interactive chat, streaming the replies")
    add_model_options(chat)
    add_sampling_options(chat, temperature=1.0)
    add_network_options(chat)
    chat.add_argument("--system", default="", help="system prompt")
    chat.add_argument("--color", choices=["auto", "always", "never"], default="auto")

    serve = sub.add_parser("serve", help="run the verifier server (the cloud side)")
    add_model_options(serve, ServerConfig, draft=False)
    g = serve.add_argument_group("server")
    g.add_argument("--host", help="address to listen on (default: "
                   f"{_default(ServerConfig, 'host')})")
    g.add_argument("--port", type=int, help="WebSocket port, -1 for none (default: "
                   f"{_default(ServerConfig, 'port')})")
    g.add_argument("--grpc-port", type=int, help="also serve gRPC on this port (0: any free "
                   "port; default: -1 = no gRPC)")
    g.add_argument("--http-port", type=int, help="also serve HTTP/JSON sessions on this port, "
                   "with /metrics and the OpenAPI schema (0: any free port; default: -1 = no "
                   "HTTP)")
    g.add_argument("--max-sessions", type=int, help="concurrent sessions at most (default: "
                   f"{_default(ServerConfig, 'max_sessions')})")
    g.add_argument("--max-context", type=int, help="context tokens per session at most "
                   f"(default: {_default(ServerConfig, 'max_context')}, and the model's own)")
    g.add_argument("--max-draft", type=int, help="drafted tokens per round at most (default: "
                   f"{_default(ServerConfig, 'max_draft')})")
    g.add_argument("--max-message-bytes", type=int, help="largest frame accepted (default: "
                   f"{_default(ServerConfig, 'max_message_bytes')})")
    g.add_argument("--max-batch", type=int, help="sessions verified in one forward pass at most "
                   f"(default: {_default(ServerConfig, 'max_batch')})")
    g.add_argument("--max-kv-bytes", type=int, help="KV cache bytes across sessions at most; "
                   "the least recently used idle sessions' caches are freed and rebuilt on "
                   "their next round (default: 0 = no cap)")
    g.add_argument("--idle-timeout", type=float, help="seconds of silence before a session is "
                   f"evicted (default: {_default(ServerConfig, 'idle_timeout')})")
    g.add_argument("--auth-token-file", help="require this bearer token (file's first line; "
                   "default: $SPECECD_AUTH_TOKEN if set, else no auth)")
    g.add_argument("--tls-cert", help="TLS certificate (PEM): serve wss://")
    g.add_argument("--tls-key", help="TLS private key (PEM)")
    g.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="logs on stderr as text or as JSON lines (with session ids)")

    bench = sub.add_parser("bench", help="measure SpecECD against the target alone, "
                           "cloud-only generation and transformers' assisted generation")
    bench.add_argument("--draft-model", help="draft model, or several separated by commas "
                       "(folders, hub ids or .gguf files) to compare in one run "
                       "(default: the project's draft)")
    bench.add_argument("--target-model", help="target model, or several separated by commas "
                       "(default: the project's target)")
    bench.add_argument("--num-prompts", type=int, default=10,
                       help="built-in held-out prompts to use (default: 10)")
    bench.add_argument("--prompts-file", type=Path,
                       help="prompts instead of the built-in ones: a JSON list of strings, or "
                       "text with prompts separated by lines holding only ---")
    bench.add_argument("--iterations", type=int, default=3,
                       help="measured passes per configuration, after one warm-up (default: 3)")
    bench.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt (default: 64)")
    bench.add_argument("--rtt-ms", default="0,20,50",
                       help="round-trip times to emulate, comma-separated (default: 0,20,50)")
    bench.add_argument("--jitter-ms", type=float, default=0.0,
                       help="round-trip jitter, uniform (default: 0)")
    bench.add_argument("--k", default="auto", help="draft lengths to compare, e.g. 2,4,8,auto "
                       "(default: auto, the adaptive policy)")
    bench.add_argument("--proactive", default="off,on,stream",
                       help="proactive drafting settings to compare for --k auto; fixed k "
                       "values run with the first one (default: off,on,stream)")
    bench.add_argument("--transport", default="websocket",
                       help="edge-cloud transports to compare, comma-separated, among "
                       "websocket,grpc,http (default: websocket)")
    bench.add_argument("--mode", choices=["exact", "match", "greedy"], default="exact")
    bench.add_argument("--temperature", type=float, default=0.0, help="default: 0 (greedy)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--host", default="127.0.0.1", help="address for the verifier server")
    bench.add_argument("--port", type=int, default=0, help="port for the server (0: any free)")
    bench.add_argument("--device", default="cpu", help="device for every model (default: cpu)")
    bench.add_argument("--no-baselines", action="store_true",
                       help="skip the target alone and transformers' assisted generation")
    bench.add_argument("--out", type=Path, default=Path("bench-out"),
                       help="folder for bench.json, bench.csv, bench.md and plots")
    bench_sub = bench.add_subparsers(dest="bench_command")
    load = bench_sub.add_parser(
        "load", help="N concurrent edge sessions against one server, against the server "
        "generating for the same N users itself")
    load.add_argument("--server", help="server URL (default: start `spececd serve` on the "
                      "default target here)")
    load.add_argument("--target-model", help="target for the server started here")
    load.add_argument("--draft-model", help="draft model: its tokenizer, and the model of "
                      "the draft clients (default: the project's draft)")
    load.add_argument("--clients", default="16",
                      help="concurrent clients; a list such as 1,2,4,8,16,32 gives a curve")
    load.add_argument("--duration", type=float, default=20.0, help="seconds per run")
    load.add_argument("--kind", default="replay,cloud-only",
                      help="replay (no model, chosen acceptance), draft (real drafter "
                      "processes), cloud-only (the baseline); comma-separated")
    load.add_argument("--acceptance", type=float, default=0.8,
                      help="replay clients: acceptance per position (default: 0.8)")
    load.add_argument("--k", type=int, default=4, help="drafted tokens per round")
    load.add_argument("--max-tokens", type=int, default=64)
    load.add_argument("--num-prompts", type=int, default=10)
    load.add_argument("--max-batch", type=int, default=32,
                      help="for the server started here: sessions per forward pass at most")
    load.add_argument("--out", type=Path, default=Path("bench-out"))

    conv = sub.add_parser("convert", help="convert a transformers model folder to GGUF with "
                          "llama.cpp's own converter")
    conv.add_argument("--to", choices=["gguf"], default="gguf")
    conv.add_argument("--quant", default="f16", help="f32, f16, bf16, q8_0 (written by the "
                      "converter) or q4_0, q4_k_m, q5_k_m, q6_k, ... (llama.cpp's quantizer)")
    conv.add_argument("model_dir", type=Path, help="folder saved with save_pretrained")
    conv.add_argument("out", type=Path, help="GGUF file to write")

    dev = sub.add_parser("devices", help="list the devices models can run on here")
    dev.add_argument("--json", action="store_true")
    return parser


def edge_config(args: argparse.Namespace) -> EdgeConfig:
    flags = {k: v for k, v in vars(args).items() if v is not None}
    return config.load(EdgeConfig, args.config, flags,
                       defaults=getattr(args, "demo_defaults", None))


def load_generator(cfg: EdgeConfig) -> Any:
    from spececd.api import Generator

    common: dict[str, Any] = dict(device=cfg.device, dtype=cfg.dtype, threads=cfg.threads,
                                  options=cfg.options)
    draft = cfg.draft_model or default_model("draft")
    if cfg.server:
        return Generator.load(draft, server=cfg.server,
                              auth_token=config.auth_token(cfg.auth_token_file),
                              tls_ca=cfg.tls_ca or None, tls_verify=cfg.tls_verify, **common)
    return Generator.load(draft, cfg.target_model or default_model("target"), **common)


def sampling_kwargs(cfg: EdgeConfig, seed: int | None) -> dict[str, Any]:
    return dict(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                top_p=cfg.top_p, seed=seed)


def use_colour(choice: str, stream: TextIO) -> bool:
    if choice != "auto":
        return choice == "always"
    return stream.isatty() and "NO_COLOR" not in os.environ


def stream_completion(gen: Any, prompt: str | list[int], kwargs: dict[str, Any],
                      colour: bool, out: TextIO) -> GenerationStats:
    """Print one completion as it is verified, accepted drafts and target tokens told apart
    by colour; return its statistics."""
    stats = GenerationStats()
    warned = False
    for chunk in gen.stream(prompt, stats, **kwargs):
        if chunk.source == "fallback" and not warned:
            warned = True
            print("\nspececd: the verifier is unreachable; the rest is the draft model's "
                  "alone, unverified", file=sys.stderr)
        if colour and chunk.text:
            out.write(COLOURS[chunk.source] + chunk.text + RESET)
        else:
            out.write(chunk.text)
        out.flush()
    out.write("\n")
    return stats


def summary_line(stats: GenerationStats) -> str:
    line = (f"{stats.tokens_per_s:.1f} tokens/s · acceptance {stats.acceptance_rate:.1%} · "
            f"mean accepted length {stats.mean_accepted_len:.2f} · {stats.generated} tokens "
            f"in {stats.wall_s:.2f} s")
    if stats.fallback:
        line += f" · {stats.fallback_tokens} tokens from the draft alone (verifier unreachable)"
    return line


def parse_prompt(args: argparse.Namespace) -> str | list[int]:
    if args.prompt is not None:
        return str(args.prompt)
    if args.prompt_file is not None:
        try:
            return str(args.prompt_file.read_text())
        except OSError as exc:
            raise InputError(f"cannot read prompt file {args.prompt_file}: "
                             f"{exc.strerror}") from None
    try:
        return [int(t) for t in str(args.prompt_ids).split(",") if t.strip()]
    except ValueError:
        raise InputError(f"--prompt-ids must be comma-separated integers, got "
                         f"{args.prompt_ids!r}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    if args.n < 1:
        raise InputError(f"--n must be >= 1, got {args.n}")
    prompt = parse_prompt(args)
    cfg = edge_config(args)
    with load_generator(cfg) as gen:
        kwargs = sampling_kwargs(cfg, args.seed)
        if args.json:
            completions = gen.generate_n(prompt, args.n, **kwargs)
            total = GenerationStats()
            for c in completions:
                total.merge(c.stats)
            print(json.dumps({
                "completions": [{"token_ids": c.token_ids, "text": c.text,
                                 "finish_reason": c.finish_reason} for c in completions],
                "stats": total.as_dict(),
            }))
            return 0
        colour = use_colour(args.color, sys.stdout)
        base_seed = gen.params(**kwargs).seed
        for i in range(args.n):
            if args.n > 1:
                print(f"--- completion {i + 1}/{args.n}", file=sys.stderr)
            stats = stream_completion(gen, prompt, {**kwargs, "seed": base_seed + i}, colour,
                                      sys.stdout)
            print(summary_line(stats), file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    cfg = edge_config(args)
    with load_generator(cfg) as gen:
        colour = use_colour(args.color, sys.stdout)
        kwargs = sampling_kwargs(cfg, args.seed)
        target = gen.target_backend.description if gen.target_backend else cfg.server
        print(f"SpecECD demo: draft {gen.draft_backend.description}\n"
              f"              target {target}\n"
              f"mode {gen.options.mode.value}, k={gen.options.k or 'auto'}, "
              f"temperature {cfg.temperature}"
              + (f"\n{COLOURS['draft']}drafted and accepted{RESET} · "
                 f"{COLOURS['target']}supplied by the target{RESET}" if colour else ""))
        total = GenerationStats()
        for i, prompt in enumerate(demo_prompts()[:args.num_prompts]):
            print(f"\n=== prompt {i + 1} ===\n{prompt}", end="")
            stats = stream_completion(gen, prompt, kwargs, colour, sys.stdout)
            print(f"--- {summary_line(stats)}")
            total.merge(stats)
        print(f"\nall prompts: {summary_line(total)}")
    return 0


def chat_prompt(gen: Any, messages: list[dict[str, str]]) -> list[int]:
    """The conversation as token ids: the tokenizer's chat template when it has one, else a
    plain transcript."""
    ids = gen.tokenizer.apply_chat_template(messages)
    if ids is not None:
        return list(ids)
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
    return list(gen.tokenizer.encode(text + "Assistant:"))


def cmd_chat(args: argparse.Namespace) -> int:
    cfg = edge_config(args)
    with load_generator(cfg) as gen:
        colour = use_colour(args.color, sys.stdout)
        messages = [{"role": "system", "content": args.system}] if args.system else []
        interactive = sys.stdin.isatty()
        print("SpecECD chat: an empty line or Ctrl-D ends it.", file=sys.stderr)
        seed = args.seed
        while True:
            if interactive:
                print("you> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line.strip():
                return 0
            messages.append({"role": "user", "content": line.strip()})
            out = io.StringIO()
            sys.stdout.write("assistant> ")
            stats = stream_completion(gen, chat_prompt(gen, messages),
                                      sampling_kwargs(cfg, seed), colour, Tee(sys.stdout, out))
            messages.append({"role": "assistant", "content": strip_ansi(out.getvalue()).strip()})
            print(summary_line(stats), file=sys.stderr)
            seed = None if seed is None else seed + 1


class Tee(io.TextIOBase):
    def __init__(self, *streams: TextIO) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    cfg = config.load(ServerConfig, args.config,
                      {k: v for k, v in vars(args).items() if v is not None})
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise InputError("TLS needs both --tls-cert and --tls-key")
    token = config.auth_token(cfg.auth_token_file)
    from spececd.backends.registry import load_backend
    from spececd.cloud.engine import Engine, EnginePolicy
    from spececd.protocol.session import Limits
    from spececd.transports.registry import Listener, serve

    backend = load_backend(cfg.target_model or default_model("target"), device=cfg.device,
                           dtype=cfg.dtype, threads=cfg.threads)
    engine = Engine(backend, Limits(cfg.max_draft, cfg.max_context, cfg.max_message_bytes),
                    EnginePolicy(cfg.max_sessions, cfg.idle_timeout, cfg.max_batch,
                                 cfg.max_kv_bytes), token)
    listeners = [Listener(name, cfg.host, port) for name, port in
                 (("websocket", cfg.port), ("grpc", cfg.grpc_port), ("http", cfg.http_port))
                 if port >= 0]
    if not listeners:
        raise InputError("no transport to serve: give --port, --grpc-port or --http-port")

    def ready(urls: list[str]) -> None:
        print(f"spececd: serving {backend.description} on {', '.join(urls)}"
              f"{' (auth required)' if token else ''}", file=sys.stderr, flush=True)

    try:
        asyncio.run(serve(engine, listeners, (cfg.tls_cert, cfg.tls_key) if cfg.tls_cert
                          else None, ready))
    except OSError as exc:
        raise InputError(f"cannot listen on {cfg.host}: {exc.strerror}") from None
    finally:
        engine.close()
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    from spececd.backends.registry import available_devices

    devices = available_devices()
    if args.json:
        print(json.dumps(devices))
    else:
        for d in devices:
            print(f"{d['device']:<10} {d['backend']:<6} {d['detail']}")
    return 0


def parse_list(text: str, kind: type, what: str) -> list[Any]:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InputError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise InputError(f"{what} is empty")
    return values


def load_prompts(path: Path) -> list[str]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise InputError(f"cannot read prompts file {path}: {exc.strerror}") from None
    if path.suffix == ".json":
        prompts = json.loads(text)
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise InputError(f"{path} must hold a JSON list of strings")
    else:
        prompts = [p.strip("\n") for p in re.split(r"(?m)^---$", text)]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise InputError(f"{path} holds no prompts")
    return prompts


def cmd_bench_load(args: argparse.Namespace) -> int:
    from spececd.backends.base import tokenizer_fingerprint
    from spececd.backends.registry import load_backend
    from spececd.bench import load
    from spececd.bench.runner import BenchConfig, start_server

    clients = [int(c) for c in parse_list(args.clients, int, "--clients")]
    kinds = [k.strip() for k in args.kind.split(",") if k.strip()]
    if not set(kinds) <= {"replay", "draft", "cloud-only"} or min(clients) < 1:
        raise InputError("--kind takes replay, draft, cloud-only; --clients numbers >= 1")
    draft_model = args.draft_model or default_model("draft")
    backend = load_backend(draft_model, device="cpu", dtype="float32")
    fingerprint = tokenizer_fingerprint(backend.tokenizer, backend.vocab_size)
    prompts = [backend.tokenizer.encode(p) for p in demo_prompts()[:args.num_prompts]]
    server = None
    url = args.server
    if not url:
        cfg = BenchConfig(draft=draft_model, target=args.target_model or default_model("target"),
                          prompts=[], max_batch=args.max_batch)
        server, ports = start_server(cfg)
        url = f"ws://127.0.0.1:{ports['websocket']}"
    try:
        rows = load.run_curve(url, fingerprint, prompts, clients, args.duration, kinds,
                              args.acceptance, args.k, args.max_tokens, draft_model,
                              progress=lambda r: print(
                                  f"{r['clients']:>3} {r['kind']:<10} "
                                  f"{r['server_tokens_per_s']:>8} tokens/s", file=sys.stderr))
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load.json").write_text(json.dumps(
        {"meta": {"server": url, "draft": draft_model, "duration_s": args.duration,
                  "k": args.k, "max_tokens": args.max_tokens, "acceptance": args.acceptance},
         "rows": rows}, indent=1))
    markdown = load.table(rows)
    (args.out / "load.md").write_text(markdown)
    load.plot(rows, args.out / "load_curve.png")
    print(markdown)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "load":
        return cmd_bench_load(args)
    from spececd.bench.runner import BenchConfig, run_bench, save

    ks: list[int | str] = [v.strip() if v.strip() == "auto" else int(parse_k(v.strip()) or 0)
                           for v in args.k.split(",") if v.strip()]
    proactive = [v.strip() for v in args.proactive.split(",") if v.strip()]
    if not ks or not proactive or not set(proactive) <= {"on", "off", "stream"}:
        raise InputError("--k needs values such as 2,4,auto and --proactive values among "
                         "off,on,stream")
    transports = [t.strip() for t in args.transport.split(",") if t.strip()]
    if not transports or not set(transports) <= {"websocket", "grpc", "http"}:
        raise InputError(f"--transport takes websocket, grpc, http; got {args.transport!r}")
    rtts = parse_list(args.rtt_ms, float, "--rtt-ms")
    if min(rtts) < 0 or args.iterations < 1 or args.max_tokens < 1:
        raise InputError("--rtt-ms must be >= 0, --iterations and --max-tokens >= 1")
    prompts = (load_prompts(args.prompts_file) if args.prompts_file
               else demo_prompts()[:args.num_prompts])
    drafts = (args.draft_model or default_model("draft")).split(",")
    targets = (args.target_model or default_model("target")).split(",")
    cfg = BenchConfig(draft=drafts[0], target=targets[0], drafts=drafts, targets=targets,
                      prompts=prompts,
                      rtt_ms=rtts, ks=ks, proactive=proactive,
                      iterations=args.iterations,
                      max_tokens=args.max_tokens, temperature=args.temperature,
                      mode=args.mode, seed=args.seed, host=args.host, port=args.port,
                      device=args.device, jitter_ms=args.jitter_ms,
                      baselines=not args.no_baselines, transports=transports)
    raw = run_bench(cfg, progress=sys.stderr.isatty())
    save(raw, args.out)
    print((args.out / "bench.md").read_text())
    print(f"wrote {args.out}/bench.json, bench.csv, bench.md and plots", file=sys.stderr)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from spececd.convert import convert

    out = convert(args.model_dir, args.out, args.quant)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {args.quant})", file=sys.stderr)
    return 0


COMMANDS = {"bench": cmd_bench, "convert": cmd_convert, "generate": cmd_generate,
            "demo": cmd_demo, "chat": cmd_chat, "serve": cmd_serve, "devices": cmd_devices}


class JsonLines(logging.Formatter):
    """One JSON object per record, with the structured fields passed as ``extra``."""

    STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                 "logger": record.name, "msg": record.getMessage()}
        entry.update({k: v for k, v in vars(record).items() if k not in self.STANDARD})
        return json.dumps(entry, default=str)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="spececd: %(message)s")
    if getattr(args, "log_format", "text") == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonLines())
    if not args.verbose:  # the hub client retries loudly when it cannot connect
        for name in ("huggingface_hub", "httpx", "transformers", "websockets"):
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        return COMMANDS[args.command](args)
    except USER_ERRORS as exc:
        print(f"spececd: error: {exc}", file=sys.stderr)
        return 2
    except SpecECDError as exc:
        print(f"spececd: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

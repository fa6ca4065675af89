"""``spececd api``: an OpenAI-compatible HTTP API (and the playground) in front of the
edge, so that applications speaking the OpenAI API generate through edge drafting."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from spececd import config
from spececd.cli.options import add_edge_options, edge_config, load_generator
from spececd.errors import InputError
from spececd.openai_api.limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_REQUEST_TIMEOUT
from spececd.openai_api.tool_parsers import PARSERS, parser


def add_parser(sub: Any) -> None:
    p = sub.add_parser("api", help="serve an OpenAI-compatible API and a playground page, "
                       "generating through edge drafting")
    # Healing is off unless asked for (per request, or for all with --token-healing), as
    # other OpenAI-compatible servers answer the prompt they were given.
    add_edge_options(p, sampling=False, healing=False)
    g = p.add_argument_group("API")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on "
                   "(default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: any)")
    g.add_argument("--model-name", default="spececd", help="the model name clients send "
                   "and GET /v1/models lists (default: spececd)")
    g.add_argument("--api-key-file", help="file holding the key clients must send as "
                   "`Authorization: Bearer KEY` (default: $SPECECD_API_KEY; none: open)")
    g.add_argument("--cloud-only", action="store_true", help="the server generates alone "
                   "(no drafting), for comparison; a request may still set cloud_only")
    g.add_argument("--max-concurrency", type=int, default=64,
                   help="sessions generating at once; more requests wait (default: 64)")
    g.add_argument("--tool-call-parser", choices=sorted(PARSERS),
                   help="the format the model writes tool calls in, parsed out of its output "
                   "into tool_calls: hermes (<tool_call> JSON, Qwen2.5/Qwen3/Hermes) or "
                   "llama3_json (Llama 3.1's JSON); default: the format the model's chat "
                   "template writes calls in, else none, and requests with tools are "
                   "refused unless tool_choice is none (config: [edge] tool_call_parser)")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="a request body over this is answered 413 "
                   f"(default: {DEFAULT_MAX_REQUEST_BYTES})")
    g.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT,
                   help="seconds a client has to send a whole request; a slower one is "
                   f"answered 408 (default: {DEFAULT_REQUEST_TIMEOUT:g})")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from spececd.openai_api.server import Api, create_app
    from spececd.transports.http.server import serve_app

    if args.max_concurrency < 1:
        raise InputError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.max_request_bytes < 1:
        raise InputError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.request_timeout <= 0:
        raise InputError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    api_key = (config.auth_token(args.api_key_file) if args.api_key_file
               else os.environ.get("SPECECD_API_KEY", "").strip())
    cfg = edge_config(args)
    if cfg.tool_call_parser:
        parser(cfg.tool_call_parser)  # a name config.toml misspells is refused before loading
    with load_generator(cfg) as gen:
        api = Api(gen, args.model_name, api_key, args.cloud_only, args.max_concurrency,
                  tool_parser=cfg.tool_call_parser or None, token_healing=cfg.token_healing,
                  max_request_bytes=args.max_request_bytes)

        def ready(port: int) -> None:
            url = f"http://{args.host}:{port}"
            tools = (f"tool calls parsed as {api.tool_parser} ({api.tool_parser_source})"
                     if api.tool_parser else "no tool-call parser: requests with tools "
                     "refused (--tool-call-parser)")
            print(f"spececd: serving the OpenAI API on {url}/v1 (model "
                  f"{args.model_name!r}; {tools}) and the playground on {url}/",
                  file=sys.stderr, flush=True)

        try:
            asyncio.run(serve_app(create_app(api), args.host, args.port, ready=ready,
                                  request_timeout=args.request_timeout))
        except OSError as exc:
            raise InputError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}; "
                             f"pick another --port") from None
        finally:
            api.close()
    return 0

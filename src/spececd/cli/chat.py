"""``spececd chat``: an interactive chat, streaming the replies."""

from __future__ import annotations

import argparse
import io
import sys
from typing import Any

from spececd.cli.options import (
    add_edge_options,
    edge_config,
    load_generator,
    sampling_kwargs,
)
from spececd.cli.output import Tee, stream_completion, strip_ansi, summary_line, use_colour


def add_parser(sub: Any) -> None:
    p = sub.add_parser("chat", help="interactive chat, streaming the replies")
    add_edge_options(p)
    p.add_argument("--system", default="", help="system prompt")
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
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
            stats = stream_completion(gen, gen.chat_ids(messages),
                                      sampling_kwargs(cfg, seed, args.stop), colour,
                                      Tee(sys.stdout, out))  # type: ignore[arg-type]
            messages.append({"role": "assistant", "content": strip_ansi(out.getvalue()).strip()})
            print(summary_line(stats), file=sys.stderr)
            seed = None if seed is None else seed + 1

"""``spececd demo``: the default pair, in-process, on built-in prompts."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from spececd.cli.options import (
    add_edge_options,
    demo_prompts,
    edge_config,
    load_generator,
    sampling_kwargs,
)
from spececd.cli.output import COLOURS, RESET, stream_completion, summary_line, use_colour
from spececd.core.stats import GenerationStats


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="run the default pair in-process on built-in prompts")
    add_edge_options(p, temperature=0.0, max_tokens=64, network=False)
    p.add_argument("--num-prompts", type=int, default=3, help="built-in prompts to run")
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
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

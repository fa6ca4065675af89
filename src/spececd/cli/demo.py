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
    # Sampled, with a repetition penalty: what the pair writes, not a greedy loop.
    # Greedy is one flag away: --temperature 0 --repetition-penalty 1.
    add_edge_options(p, temperature=0.7, max_tokens=64, repetition_penalty=1.2,
                     network=False)
    p.add_argument("--num-prompts", type=int, default=3, help="built-in prompts to run")
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    cfg = edge_config(args)
    with load_generator(cfg, "SpecECD demo", sys.stdout) as gen:
        colour = use_colour(args.color, sys.stdout)
        kwargs = sampling_kwargs(cfg, args.seed, args.stop)
        target = gen.target_backend.description if gen.target_backend else cfg.server
        print(f"              target {target}\n"
              f"mode {gen.options.mode.value}, k={gen.options.k or 'auto'}, "
              f"temperature {cfg.temperature}, repetition penalty "
              f"{cfg.repetition_penalty:g}"
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

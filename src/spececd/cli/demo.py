"""``spececd demo``: the default pair on built-in prompts, and what speculation buys.

Each prompt's completion streams as it is verified; then the same prompt runs without
speculation, in the same run: the target alone in this process (through the same backend,
:func:`~spececd.bench.alone.generate_alone`), or, with ``--server``, cloud-only generation
(the server generates every token, the edge only reads). Each prompt's line and the total
give both speeds and their ratio. A short unmeasured generation of each kind goes first, so
that neither pays the runtimes' first-call costs inside a measurement.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
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
from spececd.generator import Generator

# Greedy, so that the target alone gives the very same text and the comparison is of speed
# alone; sampling is one flag away (--temperature 0.7 --repetition-penalty 1.2).
TEMPERATURE, MAX_TOKENS, REPETITION_PENALTY = 0.0, 64, 1.0
WARM_UP_TOKENS = 8


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="run the default pair on built-in prompts, beside the "
                       "target alone")
    add_edge_options(p, temperature=TEMPERATURE, max_tokens=MAX_TOKENS,
                     repetition_penalty=REPETITION_PENALTY)
    p.add_argument("--num-prompts", type=int, default=3, help="built-in prompts to run")
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    p.set_defaults(run=run)


@dataclass
class Baseline:
    """What the run without speculation measured, over the prompts so far."""

    name: str  # "target alone" or "cloud-only"
    tokens: int = 0
    wall_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def run_baseline(gen: Generator, prompt: str, kwargs: dict[str, Any]
                 ) -> tuple[tuple[int, ...], float]:
    """The prompt's generation without speculation: its tokens and seconds."""
    if gen.target_backend is None:  # a server: it generates alone, the edge reads
        completion = gen.generate(prompt, cloud_only=True, **kwargs)
        return tuple(completion.token_ids), completion.stats.wall_s
    from spececd.bench.alone import generate_alone

    sampling = {k: v for k, v in kwargs.items() if k not in ("stop", "token_healing")}
    ids, resolved, _ = gen.prepare(prompt, token_healing=kwargs["token_healing"], **sampling)
    alone = generate_alone(gen.target_backend, ids, resolved.params)
    return alone.token_ids, alone.wall_s


def comparison(stats: GenerationStats, base: Baseline) -> str:
    """``SpecECD 250.0 tokens/s · target alone 110.0 tokens/s · 2.27x``."""
    ratio = stats.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0
    return (f"SpecECD {stats.tokens_per_s:.1f} tokens/s · {base.name} "
            f"{base.tokens_per_s:.1f} tokens/s · {ratio:.2f}x")


def run(args: argparse.Namespace) -> int:
    cfg = edge_config(args)
    with load_generator(cfg, "SpecECD demo", sys.stdout) as gen:
        colour = use_colour(args.color, sys.stdout)
        kwargs = sampling_kwargs(cfg, args.seed, args.stop)
        if kwargs["seed"] is None:  # one seed for both runs of a prompt
            kwargs["seed"] = gen.params().seed
        target = gen.target_backend.description if gen.target_backend else cfg.server
        name = "target alone" if gen.target_backend else "cloud-only"
        print(f"              target {target}\n"
              f"mode {gen.options.mode.value}, k={gen.options.k or 'auto'}, "
              f"temperature {cfg.temperature:g}, repetition penalty "
              f"{cfg.repetition_penalty:g}, token healing "
              f"{'on' if cfg.token_healing and kwargs.get('constraint') is None else 'off'}"
              f"; each prompt also runs as the "
              f"{name}, for comparison"
              + (f"\n{COLOURS['draft']}drafted and accepted{RESET} · "
                 f"{COLOURS['lookup']}looked up and accepted{RESET} · "
                 + (f"{COLOURS['forced']}forced by the constraint{RESET} · "
                    if kwargs.get("constraint") is not None else "")
                 + f"{COLOURS['target']}supplied by the target{RESET}" if colour else ""))
        prompts = demo_prompts()[:args.num_prompts]
        if prompts:  # unmeasured: the runtimes' first calls
            warm = {**kwargs, "max_tokens": min(WARM_UP_TOKENS, cfg.max_tokens)}
            gen.generate(prompts[0], **warm)
            run_baseline(gen, prompts[0], warm)
        total, base_total = GenerationStats(), Baseline(name)
        for i, prompt in enumerate(prompts):
            print(f"\n=== prompt {i + 1} ===\n{prompt}", end="")
            token_ids: list[int] = []
            stats = stream_completion(gen, prompt, kwargs, colour, sys.stdout, token_ids)
            alone_ids, seconds = run_baseline(gen, prompt, kwargs)
            base = Baseline(name, len(alone_ids), seconds)
            same = " · the same tokens" if tuple(token_ids) == alone_ids else ""
            print(f"--- {comparison(stats, base)}{same}\n    {summary_line(stats)}")
            total.merge(stats)
            base_total.tokens += base.tokens
            base_total.wall_s += base.wall_s
        print(f"\nall prompts: {comparison(total, base_total)}\n    {summary_line(total)}")
    return 0

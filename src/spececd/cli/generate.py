"""``spececd generate``: one prompt, streamed with a summary, or as one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from spececd.cli.options import (
    add_edge_options,
    edge_config,
    load_generator,
    sampling_kwargs,
)
from spececd.cli.output import stream_completion, summary_line, use_colour
from spececd.core.logprobs import TokenLogprob
from spececd.core.params import LOGPROBS_MODES, RAW
from spececd.core.stats import GenerationStats
from spececd.errors import InputError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="file holding the prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    add_edge_options(p)
    p.add_argument("--n", type=int, default=1, help="independent completions to draw")
    p.add_argument("--json", action="store_true", help="print one JSON object, no streaming")
    p.add_argument("--logprobs", type=int, metavar="N",
                   help="with --json: each generated token's log-probability under the "
                   "target and its N most likely alternatives (0-20)")
    p.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default=RAW,
                   help="which distribution --logprobs reports: the raw logits' (default) "
                   "or the one sampled from, after penalties, temperature and filters")
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    p.set_defaults(run=run)


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


def logprob_json(entry: TokenLogprob) -> dict[str, Any]:
    """One token's log-probabilities as JSON (``-inf``, which JSON lacks, as -9999)."""
    return {"token_id": entry.token_id, "logprob": max(entry.logprob, -9999.0),
            "top": [[token, max(value, -9999.0)] for token, value in entry.top]}


def run(args: argparse.Namespace) -> int:
    if args.n < 1:
        raise InputError(f"--n must be >= 1, got {args.n}")
    if args.logprobs is not None and not args.json:
        raise InputError("--logprobs is printed in the JSON output only: add --json")
    prompt = parse_prompt(args)
    cfg = edge_config(args)
    with load_generator(cfg) as gen:
        kwargs = sampling_kwargs(cfg, args.seed, args.stop)
        if args.json:
            if args.logprobs is not None:
                kwargs.update(logprobs=args.logprobs, logprobs_mode=args.logprobs_mode)
            completions = gen.generate_n(prompt, args.n, **kwargs)
            total = GenerationStats()
            for c in completions:
                total.merge(c.stats)
            print(json.dumps({
                "completions": [{"token_ids": c.token_ids, "text": c.text,
                                 "finish_reason": c.finish_reason,
                                 **({"logprobs": [logprob_json(e) for e in c.logprobs]}
                                    if c.logprobs is not None else {})}
                                for c in completions],
                "stats": total.as_dict(),
            }))
            return 0
        colour = use_colour(args.color, sys.stdout)
        sampling = {k: v for k, v in kwargs.items()  # params' own keywords
                    if k not in ("stop", "token_healing")}
        base_seed = gen.params(**sampling).seed
        assert base_seed is not None
        for i in range(args.n):
            if args.n > 1:
                print(f"--- completion {i + 1}/{args.n}", file=sys.stderr)
            stats = stream_completion(gen, prompt, {**kwargs, "seed": base_seed + i}, colour,
                                      sys.stdout)
            print(summary_line(stats), file=sys.stderr)
    return 0

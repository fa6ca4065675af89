"""The ``spececd`` command line. It owns the terminal: library code only logs.

    spececd demo                     the default pair, in-process, on built-in prompts
    spececd generate ...             one prompt, streamed or as JSON (--json)
    spececd devices                  the devices this machine can run models on

Errors a user can cause print one line, ``spececd: error: ...``, and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from spececd.core.stats import GenerationStats
from spececd.errors import InputError, SpecECDError
from spececd.protocol.errors import AuthFailed, IncompatibleModels, VersionMismatch

log = logging.getLogger("spececd")

USER_ERRORS = (InputError, IncompatibleModels, AuthFailed, VersionMismatch)
DRAFT_COLOUR, TARGET_COLOUR, RESET = "\033[32m", "\033[1;33m", "\033[0m"


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


def add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--draft-model", help="draft model: local folder or hub id "
                   "(default: the project's trained draft)")
    g.add_argument("--target-model", help="target model: local folder or hub id "
                   "(default: the project's trained target)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps "
                   "(default: auto)")
    g.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16 "
                   "(default: float32 on cpu, bfloat16 on GPUs)")
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")


def add_sampling_options(p: argparse.ArgumentParser, temperature: float) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 = greedy (default: {temperature})")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    g.add_argument("--seed", type=int, default=None, help="seed for a reproducible run")
    g.add_argument("--k", type=int, default=4, help="drafted tokens per round (default: 4)")
    g.add_argument("--mode", default="exact", choices=["exact", "match", "greedy"],
                   help="verification: exact (Leviathan et al.), match (token ids only), "
                   "greedy (temperature 0)")
    g.add_argument("--max-support", type=int, default=64,
                   help="exact mode: draft distribution cut to this many tokens (default: 64)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spececd", description="Lossless speculative decoding: a small draft model "
        "proposes, a large target model verifies.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the default pair in-process on built-in prompts")
    add_model_options(demo)
    add_sampling_options(demo, temperature=0.0)
    demo.add_argument("--num-prompts", type=int, default=3, help="built-in prompts to run")
    demo.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    demo.set_defaults(max_tokens=64)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="file holding the prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    add_model_options(gen)
    add_sampling_options(gen, temperature=1.0)
    gen.add_argument("--n", type=int, default=1, help="independent completions to draw")
    gen.add_argument("--json", action="store_true", help="print one JSON object, no streaming")
    gen.add_argument("--color", choices=["auto", "always", "never"], default="auto")

    dev = sub.add_parser("devices", help="list the devices models can run on here")
    dev.add_argument("--json", action="store_true")
    return parser


def load_generator(args: argparse.Namespace) -> Any:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    from spececd.api import Generator

    return Generator.load(args.draft_model or default_model("draft"),
                          args.target_model or default_model("target"),
                          device=args.device, dtype=args.dtype, mode=args.mode, k=args.k,
                          max_support=args.max_support)


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed)


def use_colour(choice: str, stream: TextIO) -> bool:
    if choice != "auto":
        return choice == "always"
    return stream.isatty() and "NO_COLOR" not in os.environ


def stream_completion(gen: Any, prompt: str | list[int], kwargs: dict[str, Any],
                      colour: bool, out: TextIO) -> GenerationStats:
    """Print one completion as it is verified, accepted drafts and target tokens told apart
    by colour; return its statistics."""
    stats = GenerationStats()
    for chunk in gen.stream(prompt, stats, **kwargs):
        if colour and chunk.text:
            out.write((DRAFT_COLOUR if chunk.source == "draft" else TARGET_COLOUR)
                      + chunk.text + RESET)
        else:
            out.write(chunk.text)
        out.flush()
    out.write("\n")
    return stats


def summary_line(stats: GenerationStats) -> str:
    return (f"{stats.tokens_per_s:.1f} tokens/s · acceptance {stats.acceptance_rate:.1%} · "
            f"mean accepted length {stats.mean_accepted_len:.2f} · {stats.generated} tokens "
            f"in {stats.wall_s:.2f} s")


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
    gen = load_generator(args)
    kwargs = sampling_kwargs(args)
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
    gen = load_generator(args)
    colour = use_colour(args.color, sys.stdout)
    kwargs = sampling_kwargs(args)
    print(f"SpecECD demo: draft {gen.draft_backend.description}\n"
          f"              target {gen.target_backend.description}\n"
          f"mode {gen.mode.value}, k={gen.k}, temperature {args.temperature}"
          + (f"\n{DRAFT_COLOUR}drafted and accepted{RESET} · "
             f"{TARGET_COLOUR}supplied by the target{RESET}" if colour else ""))
    total = GenerationStats()
    for i, prompt in enumerate(demo_prompts()[:args.num_prompts]):
        print(f"\n=== prompt {i + 1} ===\n{prompt}", end="")
        stats = stream_completion(gen, prompt, kwargs, colour, sys.stdout)
        print(f"--- {summary_line(stats)}")
        total.merge(stats)
    print(f"\nall prompts: {summary_line(total)}")
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="spececd: %(message)s")
    if not args.verbose:  # the hub client retries loudly when it cannot connect
        for name in ("huggingface_hub", "httpx", "transformers"):
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "demo":
            return cmd_demo(args)
        return cmd_devices(args)
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

"""Arguments the edge commands share, and what they become: an :class:`EdgeConfig` (flags
over the environment over ``config.toml``), the draft to run (:func:`choose_draft`: the
user's, or the default draft in its fastest form installed here), then a loaded Generator.

Flags default to None ("not given") so that the file and the environment show through;
the defaults the help texts name live in :class:`~spececd.core.params.SamplingParams`
(sampling), :class:`~spececd.edge.options.EdgeOptions` (speculation) and
:mod:`spececd.config` (the rest), and are read from there. Nothing here imports a model runtime: the
backend the chosen model needs is imported when it loads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from spececd import config
from spececd.backends.registry import SPECS, installed, model_format
from spececd.config import EdgeConfig, parse_logit_bias
from spececd.core.params import Mode, SamplingParams
from spececd.edge.options import DraftKind, EdgeOptions, Fallback, Proactive
from spececd.errors import InputError

if TYPE_CHECKING:
    from spececd.generator import Generator

OPTIONS = EdgeOptions()  # for the help texts' defaults
CONFIG = EdgeConfig()
SAMPLING = SamplingParams()

__all__ = ["Draft", "add_edge_options", "choose_draft", "edge_config", "load_generator",
           "parse_logit_bias", "sampling_kwargs"]


def models_dir() -> Path:
    """Where the default pair lives: $SPECECD_MODELS, else the repository's models/."""
    env = os.environ.get("SPECECD_MODELS")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "models"


def default_model(kind: str) -> str:
    path = models_dir() / kind
    if not (path / "config.json").is_file():
        raise InputError(f"the default {kind} model is not at {path}: run from a clone of the "
                         f"repository, set SPECECD_MODELS, or pass --{kind}-model")
    return str(path)


# The default draft's faster forms, fastest first (scripts/draft-runtimes.py,
# models/README.md): the name beside the default draft's folder, and its backend.
FASTER_DRAFTS = (("draft-onnx", "onnx"), ("draft.gguf", "llama.cpp"))


@dataclass(frozen=True)
class Draft:
    """The draft model an edge command runs: the one the user named, or the default draft
    in the fastest form this machine can run (:func:`choose_draft`). ``faster``: for the
    default only, the backend of a faster form that is there but not installed ('')."""

    model: str
    backend: str
    faster: str = ""

    def __str__(self) -> str:
        """What the commands' first line says: ``models/draft-onnx (ONNX Runtime GenAI)``."""
        path = Path(self.model)
        if path.is_absolute() and path.is_relative_to(Path.cwd()):
            path = path.relative_to(Path.cwd())
        hint = (f"; pip install 'spececd[{SPECS[self.faster].extra}]' to draft with its "
                f"faster {SPECS[self.faster].runtime} form" if self.faster else "")
        return f"{path} ({SPECS[self.backend].runtime}{hint})"


def choose_draft(model: str | None, device: str = "auto") -> Draft:
    """``model`` when the user gave one (flag, environment or config file), else the
    default draft in the first of :data:`FASTER_DRAFTS` that is in :func:`models_dir` with
    its runtime installed, else its transformers folder (whose loading says what to
    install when torch is missing). The faster forms are builds for the CPU: on another
    ``device`` than ``auto`` or ``cpu`` the transformers folder runs, on that device. Any
    form gives the target's output: the draft only proposes."""
    if model:
        return Draft(model, model_format(model))
    faster = ""
    for name, backend in FASTER_DRAFTS if device in ("auto", "cpu") else ():
        path = models_dir() / name
        if path.exists() and model_format(str(path)) == backend:
            if installed(backend):
                return Draft(str(path), backend, faster)
            faster = faster or backend
    return Draft(default_model("draft"), "hf", faster)


def demo_prompts() -> list[str]:
    path = models_dir() / "heldout_prompts.json"
    if not path.is_file():
        raise InputError(f"no built-in prompts at {path}: set SPECECD_MODELS to the models/ "
                         f"folder of a clone of the repository")
    return list(json.loads(path.read_text()))


def add_model_options(p: argparse.ArgumentParser, draft: bool = True) -> None:
    g = p.add_argument_group("models")
    if draft:
        g.add_argument("--draft-model", help="draft model: local folder, hub id or .gguf file "
                       "(default: the project's trained draft in its fastest form this "
                       "machine runs: on device auto or cpu, models/draft-onnx on ONNX "
                       "Runtime GenAI, models/draft.gguf on llama.cpp, else models/draft on "
                       "transformers)")
    g.add_argument("--target-model", help="target model: local folder or hub id "
                   "(default: the project's trained target)")
    g.add_argument("--device", help="auto, cpu, cuda, cuda:N, mps or npu (the NPU of an "
                   "OpenVINO or ONNX model's runtime, else the cpu with a notice); ONNX "
                   "models also dml and qnn, OpenVINO gpu; `spececd devices` lists them "
                   "(default: auto)")
    g.add_argument("--dtype", help="auto, float32, float16 or bfloat16 (default: auto = the "
                   "model's own dtype where the device computes it faster: GPUs, and "
                   "bfloat16 on CPUs with AMX; float32 elsewhere)")
    g.add_argument("--threads", type=int, help="CPU threads (default: on transformers, all "
                   "cores but one for a target and for an in-process pair, one for a draft "
                   "beside a remote verifier, so that an edge and a server on one machine do "
                   "not spin on each other's cores; other runtimes: their own choice, and a "
                   "draft on another runtime than the target's runs on one)")
    g.add_argument("--config", type=Path, help="config.toml to read settings from; flags and "
                   "SPECECD_* environment variables override it")


def add_sampling_options(p: argparse.ArgumentParser, temperature: float,
                         max_tokens: int, repetition_penalty: float) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int,
                   help=f"tokens to generate at most (default: {max_tokens})")
    g.add_argument("--temperature", type=float, help=f"0 = greedy (default: {temperature})")
    g.add_argument("--top-k", type=int, help="keep the k most likely tokens (default: "
                   f"{SAMPLING.top_k} = off)")
    g.add_argument("--top-p", type=float, help="nucleus sampling mass (default: "
                   f"{SAMPLING.top_p:g} = off)")
    g.add_argument("--seed", type=int, default=None, help="seed for a reproducible run")
    g.add_argument("--min-p", type=float, help="drop tokens below this share of the most "
                   f"likely one's probability (default: {SAMPLING.min_p:g} = off)")
    g.add_argument("--repetition-penalty", type=float, help="> 1 makes tokens of the prompt "
                   "and output so far less likely, as in transformers (default: "
                   f"{repetition_penalty:g}; 1 = off)")
    g.add_argument("--presence-penalty", type=float, help="OpenAI's: subtracted from the "
                   "logit of every token the output has used, -2 to 2 (default: "
                   f"{SAMPLING.presence_penalty:g})")
    g.add_argument("--frequency-penalty", type=float, help="OpenAI's: subtracted once per "
                   "use of a token in the output, -2 to 2 (default: "
                   f"{SAMPLING.frequency_penalty:g})")
    g.add_argument("--logit-bias", help="added to token logits: ID:BIAS,ID:BIAS "
                   "(bias -100 to 100; -100 bans the token)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the completion at this text, left out of it (repeatable)")
    c = p.add_argument_group("constraint (at most one; the verifier enforces it, the draft "
                             "follows it)")
    c.add_argument("--json-schema", metavar="FILE", help="the output is JSON matching this "
                   "schema (a JSON file)")
    c.add_argument("--regex", help="the output matches this regular expression")
    c.add_argument("--choice", action="append", default=None, metavar="TEXT",
                   help="the output is one of these strings (repeat the flag once per "
                   "choice; a choice may contain commas)")
    c.add_argument("--grammar", metavar="FILE", help="the output follows this grammar "
                   "(EBNF/GBNF with a root rule, or Lark)")


def add_prompt_options(p: argparse.ArgumentParser, healing: bool | None = None) -> None:
    """``healing``: the command's own default for --token-healing, for its help (None: the
    config's)."""
    default = CONFIG.token_healing if healing is None else healing
    g = p.add_argument_group("prompt")
    g.add_argument("--token-healing", action=argparse.BooleanOptionalAction, default=None,
                   help="heal a text prompt's last token: drop it and let the first generated "
                   "token spell it, so a prompt cut inside what the tokenizer writes as one "
                   "token (a newline before indentation) continues as the model would; the "
                   "output is the target's own for the prompt without that token, the first "
                   "token restricted to those whose text starts with it (default: "
                   f"{'on' if default else 'off'})")


def add_speculation_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation")
    g.add_argument("--draft", "--draft-source", dest="draft_source",
                   choices=[kind.value for kind in DraftKind],
                   help="where drafts come from: model (the draft model); lookup (the "
                   "longest recent suffix of the text, found earlier in the prompt and the "
                   "output, proposes what followed it: no model, no torch); suffix (a "
                   "suffix trie of the text, proposing token trees where --tree-width asks, "
                   "and with --lookup-memory the session's earlier generations: no "
                   "model); hybrid (lookup where it matches, the "
                   "model elsewhere); default: auto = hybrid, or lookup with no draft "
                   "model to load")
    g.add_argument("--k", help="drafted tokens per round, or auto: chosen each round from "
                   "measured acceptance, draft, verify and network costs (default: "
                   f"{OPTIONS.k or 'auto'})")
    g.add_argument("--proactive", choices=[choice.value for choice in Proactive],
                   help="on: draft the next block while a verdict is in flight; stream: the "
                   "server generates without waiting for drafts and the edge streams drafts "
                   "ahead of it (fastest on a slow link); off: plain rounds; default: "
                   f"{OPTIONS.proactive.value} = with --server, off, on or stream, whichever "
                   "this link makes fastest (measured as it goes); in-process, off")
    g.add_argument("--mode", choices=[mode.value for mode in Mode],
                   help="verification: exact (Leviathan et al., default), match (token ids "
                   "only), greedy (temperature 0); threshold is LOSSY, for experiments: "
                   "keep a drafted token when the target gives it at least --threshold")
    g.add_argument("--threshold", type=float, help="threshold mode: the target probability "
                   "a drafted token needs to be kept, in (0, 1]")
    g.add_argument("--max-support", type=int, help="exact mode: draft distribution cut to "
                   f"this many tokens (default: {OPTIONS.max_support})")
    g.add_argument("--tree-width", type=int, help="draft token trees: up to this many "
                   "candidates where the draft is unsure (a server whose target has tree "
                   f"attention verifies them in one pass; default: {OPTIONS.tree_width}, "
                   "chains)")
    g.add_argument("--lookup-memory", action=argparse.BooleanOptionalAction, default=None,
                   help="suffix drafting (and the hybrid, which then looks up with it) also "
                   "looks up this session's earlier generations (an agent's repeated tool "
                   "output, a chat's earlier answers); a seed then repeats its sampled "
                   "output only in a fresh session (default: off)")
    g.add_argument("--constrained-drafting", action=argparse.BooleanOptionalAction,
                   default=None, help="under a constraint, draft under it too: the draft "
                   "stays valid and the tokens it forces are proposed without the draft "
                   "model; --no-constrained-drafting drafts unconstrained and leaves the "
                   "constraint to the verifier (default: on)")


def add_network_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("network (edge + cloud)")
    g.add_argument("--server", help="verifier URL: ws://, wss://, grpc://, grpcs://, http:// or "
                   "https://HOST:PORT; without it the target runs in this process")
    g.add_argument("--auth-token-file", help="file holding the bearer token "
                   "(default: $SPECECD_AUTH_TOKEN)")
    g.add_argument("--tls-ca", help="CA certificate to verify a wss:// server with")
    g.add_argument("--target-tokenizer", help="the server's target tokenizer (transformers "
                   "folder or hub id) when the draft model's is another: the edge then "
                   "drafts across the two, verified by match (lossless)")
    g.add_argument("--insecure", dest="tls_verify", action="store_const", const=False,
                   help="do not verify the server's TLS certificate")
    g.add_argument("--round-timeout", type=float, help="seconds to wait for the verifier's "
                   "reply before treating the link as dead and reconnecting (a hung replica "
                   f"behind a balancer costs this long; default: {CONFIG.round_timeout:g})")
    g.add_argument("--reconnect-timeout", type=float, help="seconds to keep reconnecting "
                   "when the link fails, with backoff and jitter, before giving up "
                   f"(default: {OPTIONS.reconnect.timeout:g})")
    g.add_argument("--reconnect-attempts", help="reconnections tried at most within that "
                   "time (default: unlimited)")
    g.add_argument("--reconnect-delay", type=float,
                   help="seconds before the first reconnection, doubled each time "
                   f"(default: {OPTIONS.reconnect.delay})")
    g.add_argument("--fallback", choices=[choice.value for choice in Fallback],
                   help="when the verifier is unreachable: none = fail (default), draft = "
                   "finish with the draft model alone, marked as such")


def add_edge_options(p: argparse.ArgumentParser, temperature: float = CONFIG.temperature,
                     max_tokens: int = CONFIG.max_tokens,
                     repetition_penalty: float = CONFIG.repetition_penalty,
                     network: bool = True, sampling: bool = True,
                     healing: bool | None = None) -> None:
    """Everything an edge command takes: models, speculation, sampling (unless
    ``sampling`` is False: the requests bring theirs) and, unless ``network`` is False, the
    link to a server; ``healing``: the command's default for token healing (None: the
    config's)."""
    add_model_options(p)
    add_prompt_options(p, healing)
    if sampling:
        add_sampling_options(p, temperature, max_tokens, repetition_penalty)
    add_speculation_options(p)
    if network:
        add_network_options(p)
    defaults: dict[str, Any] = {"temperature": temperature, "max_tokens": max_tokens,
                                "repetition_penalty": repetition_penalty}
    if healing is not None:  # config.toml, the environment and the flag still override it
        defaults["token_healing"] = healing
    if any(getattr(CONFIG, name) != value for name, value in defaults.items()):
        p.set_defaults(edge_defaults=defaults)


def edge_config(args: argparse.Namespace) -> EdgeConfig:
    flags = {k: v for k, v in vars(args).items() if v is not None}
    return config.load(EdgeConfig, args.config, flags,
                       defaults=getattr(args, "edge_defaults", None))


def needs_model(options: EdgeOptions) -> bool:
    """Whether drafting as ``options`` say needs a draft model loaded: not for lookup
    drafts alone."""
    return options.draft_source not in (DraftKind.LOOKUP, DraftKind.SUFFIX)


def spare_cores() -> int:
    """The cores this process may run on, less one (at least one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1
    return max(1, cores - 1)


def edge_threads(cfg: EdgeConfig, draft: str | None) -> int:
    """The torch threads of an edge's transformers models: ``--threads`` when given, else
    one for a draft beside a verifier elsewhere (its step is faster on one: 3.38 ms against
    3.73 for the default draft at two), and all cores but one for the models of an
    in-process pair (on two cores, one each: each then runs on its own thread, a draft step
    beside another session's verification; see backends.hf.model_thread), the target of a
    draft on another runtime too where that is one thread. Other runtimes keep their own
    choice (0). Measured with scripts/bench-concurrent.py: four clients of
    ``spececd api`` beside ``spececd serve`` on two cores went from 7-20 to 74-90 tokens/s
    with one thread each, as idle OpenMP workers no longer spin on the other's core."""
    if cfg.threads:
        return cfg.threads
    if cfg.server:
        return 1 if draft is not None and model_format(draft) == "hf" else 0
    if model_format(cfg.target_model or default_model("target")) != "hf":
        return 0
    if draft is None or model_format(draft) == "hf" or spare_cores() == 1:
        # One count serves both models (Generator.load): a draft on another runtime takes
        # it too, so it is given only where it is one thread (two cores).
        return spare_cores()
    return 0


def load_generator(cfg: EdgeConfig, name: str = "spececd", out: TextIO | None = None
                   ) -> Generator:
    """A generator drafting with :func:`choose_draft` of ``cfg.draft_model`` (none when
    it drafts by lookup alone), which the command names first, before the models load:
    ``{name}: draft ...`` on ``out`` (standard error unless given)."""
    from spececd.generator import Generator

    draft = choose_draft(cfg.draft_model, cfg.device) if needs_model(cfg.options) else None
    said = draft if draft is not None else f"{cfg.options.draft_source.value} (no draft model)"
    target = cfg.target_model or default_model("target")
    if not cfg.server and model_format(target) == "hf":  # the dtype it will load in, and why
        from spececd.backends.hf import choose_dtype, resolve_device

        dtype = choose_dtype(cfg.dtype, resolve_device(cfg.device), target)[1]
        said = f"{said} · target in {dtype}"
    print(f"{name}: draft {said}", file=out or sys.stderr, flush=True)
    common: dict[str, Any] = dict(device=cfg.device, dtype=cfg.dtype,
                                  threads=edge_threads(cfg, draft.model if draft else None),
                                  npu=cfg.npu, options=cfg.options)
    model = draft.model if draft is not None else None
    if cfg.server:
        return Generator.load(model, server=cfg.server,
                              auth_token=config.auth_token(cfg.auth_token_file),
                              tls_ca=cfg.tls_ca or None, tls_verify=cfg.tls_verify,
                              target_tokenizer=cfg.target_tokenizer or None,
                              round_timeout=cfg.round_timeout, **common)
    return Generator.load(model, target, **common)


def sampling_kwargs(cfg: EdgeConfig, seed: int | None, stop: list[str] | None = None
                    ) -> dict[str, Any]:
    """What ``Generator.stream`` takes for a generation with ``cfg``'s sampling settings
    (and its token healing, which applies to text prompts)."""
    return {**cfg.sampling(), "seed": seed, "stop": stop or [],
            "token_healing": cfg.token_healing}

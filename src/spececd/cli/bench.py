"""``spececd bench``: SpecECD side by side with the target alone, cloud-only generation
and transformers' assisted generation; ``spececd bench load``: one server under N
concurrent sessions. The measuring lives in :mod:`spececd.bench`; this is the command.

Both log as they go (each process's start and load time, each pass or row) and stop with
an error naming the process that showed no progress within ``--stall-timeout``."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

from spececd import processes
from spececd.bench import window
from spececd.bench.child import STALL_S
from spececd.bench.runner import BenchConfig
from spececd.cli.options import choose_draft, default_model, demo_prompts
from spececd.config import EdgeConfig
from spececd.core.params import Mode
from spececd.edge.options import DraftKind, Proactive, parse_k
from spececd.errors import InputError

MODES = [mode.value for mode in Mode if not mode.lossy]  # the bench compares lossless runs
PROACTIVE = [choice.value for choice in Proactive]
log = logging.getLogger("spececd.bench.cli")
PLAN = BenchConfig(draft="", target="", prompts=[])  # the flags' defaults: the plan's own
DTYPES = ["auto", "float32", "bfloat16", "float16"]


def add_device_options(p: argparse.ArgumentParser) -> None:
    """Where the models run, and how long a process may show no progress: the same flags
    for ``bench`` and ``bench load``."""
    p.add_argument("--device", default=PLAN.device,
                   help=f"device for the target: the server's, the target alone's, "
                   f"assisted generation's (default: {PLAN.device})")
    p.add_argument("--dtype", choices=DTYPES, default=PLAN.dtype,
                   help="the target's dtype wherever it runs (default: auto = float32 on "
                   "a CPU, bfloat16 on a GPU)")
    p.add_argument("--draft-device", default=PLAN.draft_device,
                   help="device for the edge's draft, in its own dtype for that device "
                   f"(default: {PLAN.draft_device}; the draft's runtime is its model's: "
                   "the default draft is its fastest form this device runs, as for the "
                   "other commands)")
    p.add_argument("--stall-timeout", type=float, default=STALL_S, metavar="SECONDS",
                   help="stop with an error naming the process when one shows no progress "
                   f"for this long: a server's start, a worker's load, a pass over one "
                   f"prompt, a load row past its duration (default: {STALL_S:g})")


def add_parser(sub: Any) -> None:
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
    bench.add_argument("--iterations", type=int, default=PLAN.iterations,
                       help="measured passes per configuration, after one warm-up (default: "
                       f"{PLAN.iterations})")
    bench.add_argument("--max-tokens", type=int, default=PLAN.max_tokens,
                       help=f"tokens per prompt (default: {PLAN.max_tokens})")
    bench.add_argument("--rtt-ms", default="0,20,50",
                       help="round-trip times to emulate, comma-separated (default: 0,20,50)")
    bench.add_argument("--jitter-ms", type=float, default=0.0,
                       help="round-trip jitter, uniform (default: 0)")
    bench.add_argument("--k", default="auto", help="draft lengths to compare, e.g. 2,4,8,auto "
                       "(default: auto, the adaptive policy)")
    bench.add_argument("--proactive", default=",".join(PLAN.proactive),
                       help="proactive drafting settings to compare for --k auto; fixed k "
                       "values run with the first one (default: off,on,stream,auto; auto "
                       "chooses among off, on and stream as it goes, the default against a "
                       "server)")
    bench.add_argument("--tree-width", default="1",
                       help="token tree widths to compare, comma-separated, for every "
                       "proactive setting (1: chains; e.g. 1,3; default: 1)")
    bench.add_argument("--draft-source", default="auto",
                       help="where the edge's drafts come from, comma-separated to compare: "
                       "auto (the edge's default: hybrid), model, lookup, suffix, hybrid "
                       "(lookup and suffix: no model; see spececd generate --help)")
    bench.add_argument("--transport", default="websocket",
                       help="edge-cloud transports to compare, comma-separated, among "
                       "websocket,grpc,http (default: websocket)")
    bench.add_argument("--mode", choices=MODES, default=PLAN.mode)
    bench.add_argument("--temperature", type=float, default=PLAN.temperature,
                       help=f"default: {PLAN.temperature:g} (greedy)")
    bench.add_argument("--seed", type=int, default=PLAN.seed)
    bench.add_argument("--host", default="127.0.0.1", help="address for the verifier server")
    bench.add_argument("--port", type=int, default=0, help="port for the server (0: any free)")
    add_device_options(bench)
    bench.add_argument("--json-schema", type=Path, metavar="FILE",
                       help="also generate under this JSON schema (a JSON file): the target "
                       "alone, cloud-only, and SpecECD with the first --k and --proactive "
                       "values drafting under the schema and unconstrained, at every RTT")
    bench.add_argument("--no-baselines", action="store_true",
                       help="skip the target alone and transformers' assisted generation "
                       "(with --json-schema, the target alone under the schema still runs)")
    bench.add_argument("--api-rows", action="store_true",
                       help="also measure through `spececd api`, started as a user starts "
                       "it: 4 concurrent clients (in front of `spececd serve`, and with the "
                       "pair in-process) and chat requests constrained and not")
    bench.add_argument("--edit-set", type=Path, metavar="FILE",
                       help="also measure code edits through `spececd api` in front of "
                       "`spececd serve` at RTT 0 (e.g. models/edit_set.json, built by "
                       "scripts/make-edit-set.py): Predicted Outputs with the original as the "
                       "prediction, lookup alone, the draft model alone and cloud-only")
    bench.add_argument("--out", type=Path, default=Path("bench-out"),
                       help="folder for bench.json, bench.csv, bench.md and plots "
                       "(plots: where matplotlib is installed)")
    bench_sub = bench.add_subparsers(dest="bench_command")
    load = bench_sub.add_parser(
        "load", help="N concurrent edge sessions against one server, against the server "
        "generating for the same N users itself")
    load.add_argument("--server", help="server URL (default: start `spececd serve` on the "
                      "default target here)")
    load.add_argument("--replicas", help="when --server is a load balancer: its replicas' "
                      "URLs, comma-separated, whose metrics are summed (passes, batch sizes)")
    load.add_argument("--target-model", help="target for the server started here")
    load.add_argument("--draft-model", help="draft model: its tokenizer, and the model of "
                      "the draft clients (default: the project's draft in its fastest form "
                      "installed here, as for the other commands)")
    load.add_argument("--clients", default="16",
                      help="concurrent clients; a list such as 1,2,4,8,16,32 gives a curve")
    load.add_argument("--duration", type=float, default=20.0,
                      help="seconds each row is measured, after its clients have joined "
                      "and warmed up (default: 20); a window too short to be steady is "
                      "flagged")
    load.add_argument("--warmup-s", type=float, default=window.WARMUP_S,
                      help="seconds between the last client's first token and the measured "
                      f"window (default: {window.WARMUP_S:g})")
    load.add_argument("--arrival", default="all",
                      help="how the clients join: all (at once), stagger (client i of N "
                      "after i x --ramp-s / N seconds), or all,stagger for rows of each "
                      "(default: all)")
    load.add_argument("--ramp-s", type=float, default=window.RAMP_S,
                      help="--arrival stagger: seconds over which the clients join "
                      f"(default: {window.RAMP_S:g})")
    load.add_argument("--kind", default="replay,cloud-only",
                      help="replay (no model, chosen acceptance, rounds), replay-stream (the "
                      "same, stream drafting), draft (real drafter processes; draft-stream: "
                      "stream drafting), lookup / suffix (drafting clients that run no "
                      "model: prompt lookup, suffix drafting; -stream: stream drafting), "
                      "cloud-only "
                      "(the baseline), vllm-spec (vLLM's own "
                      "speculative decoding with the draft model on the server, through "
                      "its OpenAI server; needs vLLM); comma-separated")
    load.add_argument("--engine", default="builtin",
                      help="the server engines to run side by side: builtin, vllm, or "
                      "builtin,vllm (one server started here for each)")
    load.add_argument("--acceptance", default="0.8",
                      help="replay clients: acceptance per position, or several separated "
                      "by commas (e.g. 0.6,0.8: replay rows at each) (default: 0.8)")
    load.add_argument("--k", type=int, default=4, help="drafted tokens per round")
    load.add_argument("--temperature", type=float, default=0.0,
                      help="0: greedy (default); above: sampled, verified by match (replay "
                      "clients propose the target's own sampled continuation for their seed; "
                      "the table gives the acceptance measured)")
    load.add_argument("--max-tokens", type=int, default=64)
    load.add_argument("--num-prompts", type=int, default=10)
    load.add_argument("--prompts-file", type=Path,
                      help="prompts instead of the built-in ones (as for spececd bench), "
                      "e.g. models/copy_prompts.json: text that copies itself")
    load.add_argument("--max-batch", type=int, default=32,
                      help="for the server started here: sessions per forward pass at most")
    load.add_argument("--token-budget",
                      help="for the servers started here: their --token-budget values, "
                      "comma-separated (e.g. auto,off: one server for each, every row run "
                      "on each in turn; default: the server's own default, not passed)")
    add_device_options(load)
    load.add_argument("--out", type=Path, default=Path("bench-out"))
    bench.set_defaults(run=run)


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


def run_load(args: argparse.Namespace) -> int:
    from spececd.backends.base import tokenizer_fingerprint
    from spececd.backends.registry import load_backend
    from spececd.bench import load, load_report, report
    from spececd.bench.processes import resolved_dtype, start_openai_server, start_server

    clients = [int(c) for c in parse_list(args.clients, int, "--clients")]
    kinds = [k.strip() for k in args.kind.split(",") if k.strip()]
    engines = [e.strip() for e in args.engine.split(",") if e.strip()]
    known = {"replay", "replay-stream", "draft", "draft-stream", "lookup", "lookup-stream",
             "suffix", "suffix-stream", "cloud-only", "vllm-spec"}
    if not set(kinds) <= known or min(clients) < 1:
        raise InputError(f"--kind takes {', '.join(sorted(known))}; --clients numbers >= 1")
    if not engines or not set(engines) <= {"builtin", "vllm"}:
        raise InputError("--engine takes builtin, vllm or builtin,vllm")
    if args.server and (len(engines) > 1 or "vllm-spec" in kinds):
        raise InputError("with --server, the bench runs against that one server: give one "
                         "--engine (what it runs, for the report) and no vllm-spec")
    if args.temperature < 0:
        raise InputError(f"--temperature must be >= 0, got {args.temperature}")
    if "vllm-spec" in kinds and "vllm" not in engines:
        raise InputError("vllm-spec is a vLLM row: add vllm to --engine")
    arrivals = [a.strip() for a in args.arrival.split(",") if a.strip()]
    if not arrivals or not set(arrivals) <= set(window.ARRIVALS):
        raise InputError(f"--arrival takes {', '.join(window.ARRIVALS)}, comma-separated; "
                         f"got {args.arrival!r}")
    if args.duration <= 0 or args.warmup_s < 0 or args.ramp_s < 0:
        raise InputError("--duration must be > 0 seconds, --warmup-s and --ramp-s >= 0")
    budgets: list[str | None] = (
        [b.strip() for b in args.token_budget.split(",") if b.strip()]
        if args.token_budget else [None])
    if not budgets:
        raise InputError("--token-budget is empty: give values such as auto,off")
    if args.server and args.token_budget:
        raise InputError("--token-budget is for the servers started here: give it to the "
                         "server at --server as it starts (spececd serve --token-budget)")
    acceptances = parse_list(args.acceptance, float, "--acceptance")
    if not all(0 <= a <= 1 for a in acceptances):
        raise InputError(f"--acceptance takes values between 0 and 1, got {args.acceptance!r}")
    draft = choose_draft(args.draft_model, args.draft_device)
    draft_model = draft.model
    log.info("draft: %s on %s", draft, args.draft_device)
    # vLLM's own speculation loads the draft as a transformers model
    server_draft = draft_model if draft.backend == "hf" or args.draft_model \
        else default_model("draft")
    target_model = args.target_model or default_model("target")
    backend = load_backend(draft_model, device=args.draft_device, dtype="auto")
    fingerprint = tokenizer_fingerprint(backend.tokenizer, backend.vocab_size)
    texts = (load_prompts(args.prompts_file) if args.prompts_file
             else demo_prompts())[:args.num_prompts]
    prompts = [backend.tokenizer.encode(p) for p in texts]
    replicas = [r.strip() for r in (args.replicas or "").split(",") if r.strip()]
    if replicas and not args.server:
        raise InputError("--replicas goes with --server (the balancer in front of them)")

    def progress(row: dict[str, Any]) -> None:
        ttft, rounds = row.get("ttft_ms") or {}, row.get("round_latency_ms") or {}
        print(f"{row['clients']:>3} {load_report.kind_label(row):<10} {row['arrival']:<7} "
              f"{row.get('token_budget') or '':<5} {row['server_tokens_per_s']:>8} "
              f"tokens/s, {row['client_tokens_per_s']} per client, TTFT p50 "
              f"{ttft.get('p50', '–')} ms, round p50 {rounds.get('p50', '–')} p99 "
              f"{rounds.get('p99', '–')} ms" + ("" if row["steady"] else ", NOT STEADY"),
              file=sys.stderr)

    def curve(servers: list[tuple[str, dict[str, Any]]], curve_kinds: list[str],
              draft: str, **extra: Any) -> list[dict[str, Any]]:
        return load.run_curve(servers, fingerprint, prompts, clients, args.duration,
                              curve_kinds, acceptances, args.k, args.max_tokens,
                              draft, progress=progress,
                              temperature=args.temperature, stall_s=args.stall_timeout,
                              warmup_s=args.warmup_s, arrivals=arrivals,
                              ramp_s=args.ramp_s, **extra)

    rows: list[dict[str, Any]] = []
    urls: list[str] = []
    ours = [k for k in kinds if k != "vllm-spec"]
    for engine in engines if ours else []:
        started = []  # one server for each token budget, every row run on each in turn
        try:
            servers: list[tuple[str, dict[str, Any]]] = []
            for budget in budgets:
                url = args.server
                if not url:
                    cfg = BenchConfig(draft=draft_model, target=target_model, prompts=[],
                                      max_batch=args.max_batch, engine=engine,
                                      device=args.device, dtype=args.dtype,
                                      stall_s=args.stall_timeout, token_budget=budget)
                    server, ports = start_server(cfg)
                    started.append(server)
                    url = f"ws://127.0.0.1:{ports['websocket']}"
                urls.append(url)
                servers.append((url, {"engine": engine, "token_budget": budget}))
            rows += curve(servers, ours, draft_model, replicas=replicas,
                          draft_device=args.draft_device)
        finally:
            for server in started:
                server.terminate()
                server.wait(60)
    if "vllm-spec" in kinds:  # vLLM speculating with the draft on the server
        server, url = start_openai_server(target_model, server_draft, args.k, args.max_batch,
                                          resolved_dtype(args.dtype, args.device, target_model),
                                          args.stall_timeout)
        urls.append(url)
        try:
            rows += curve([(url, {"engine": "vllm"})], ["vllm-spec"], server_draft,
                          model=target_model)
        finally:
            server.terminate()
            server.wait(60)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load.json").write_text(json.dumps(
        {"meta": {"servers": urls, "replicas": replicas or urls, "draft": draft_model,
                  "target": target_model, "engines": engines, "duration_s": args.duration,
                  "warmup_s": args.warmup_s, "arrivals": arrivals, "ramp_s": args.ramp_s,
                  "token_budgets": budgets, "steady_spread": window.STEADY_SPREAD,
                  "k": args.k, "max_tokens": args.max_tokens, "acceptance": acceptances,
                  "temperature": args.temperature, "device": args.device,
                  "dtype": resolved_dtype(args.dtype, args.device, target_model),
                  "draft_device": args.draft_device},
         "rows": rows}, indent=1))
    markdown = load_report.table(rows)
    (args.out / "load.md").write_text(markdown)
    (args.out / "load.csv").write_text(load_report.to_csv(rows))
    plotted = report.draw(load_report.plot, rows, args.out / "load_curve.png")
    print(markdown)
    print(f"wrote {args.out}/load.json, load.md, load.csv"
          + (", load_curve.png" if plotted else ""), file=sys.stderr)
    return 0


def check_edit_set(path: Path) -> None:
    """A code-edit set as ``--edit-set`` takes it (InputError if not): a JSON list of
    objects, each with a ``prompt``, the ``original`` text (the prediction) and
    ``max_tokens``."""
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"--edit-set {path}: cannot read it as JSON ({exc})") from None
    if not isinstance(items, list) or not items or not all(
            isinstance(i, dict) and isinstance(i.get("prompt"), str)
            and isinstance(i.get("original"), str) and isinstance(i.get("max_tokens"), int)
            for i in items):
        raise InputError(f"--edit-set {path}: needs a JSON list of objects with prompt, "
                         f"original and max_tokens, as scripts/make-edit-set.py writes")


def run(args: argparse.Namespace) -> int:
    with processes.ended_with_this_one():  # its servers and workers end with it, however
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    # A long run is never silent: the bench's own progress shows without --verbose.
    bench_log = logging.getLogger("spececd.bench")
    if bench_log.getEffectiveLevel() > logging.INFO:
        bench_log.setLevel(logging.INFO)
    if args.stall_timeout <= 0:
        raise InputError(f"--stall-timeout must be > 0 seconds, got {args.stall_timeout}")
    if args.bench_command == "load":
        return run_load(args)
    from spececd.bench.runner import run_bench, save

    ks: list[int | str] = [v.strip() if v.strip() == "auto" else int(parse_k(v.strip()) or 0)
                           for v in args.k.split(",") if v.strip()]
    proactive = [v.strip() for v in args.proactive.split(",") if v.strip()]
    if not ks or not proactive or not set(proactive) <= set(PROACTIVE):
        raise InputError("--k needs values such as 2,4,auto and --proactive values among "
                         "off,on,stream,auto")
    transports = [t.strip() for t in args.transport.split(",") if t.strip()]
    if not transports or not set(transports) <= {"websocket", "grpc", "http"}:
        raise InputError(f"--transport takes websocket, grpc, http; got {args.transport!r}")
    sources = [s.strip() for s in args.draft_source.split(",") if s.strip()]
    if not sources or not set(sources) <= {kind.value for kind in DraftKind}:
        raise InputError(f"--draft-source takes {', '.join(k.value for k in DraftKind)}, "
                         f"comma-separated; got {args.draft_source!r}")
    trees = parse_list(args.tree_width, int, "--tree-width")
    if min(trees) < 1:
        raise InputError(f"--tree-width takes widths >= 1, got {args.tree_width!r}")
    rtts = parse_list(args.rtt_ms, float, "--rtt-ms")
    if min(rtts) < 0 or args.iterations < 1 or args.max_tokens < 1:
        raise InputError("--rtt-ms must be >= 0, --iterations and --max-tokens >= 1")
    prompts = (load_prompts(args.prompts_file) if args.prompts_file
               else demo_prompts()[:args.num_prompts])
    if args.edit_set:
        check_edit_set(args.edit_set)
    # The file read and checked as generate's --json-schema is (InputError if not a schema).
    schema = EdgeConfig(json_schema=str(args.json_schema or "")).constraint()
    # The default draft is the other commands' (its fastest form installed here); assisted
    # generation, transformers' own, drafts with the transformers form of it.
    draft = choose_draft(args.draft_model, args.draft_device)
    drafts = args.draft_model.split(",") if args.draft_model else [draft.model]
    log.info("draft: %s on %s", ", ".join(drafts) if args.draft_model else draft,
             args.draft_device)
    targets = (args.target_model or default_model("target")).split(",")
    cfg = BenchConfig(draft=drafts[0], target=targets[0], drafts=drafts, targets=targets,
                      prompts=prompts,
                      rtt_ms=rtts, ks=ks, proactive=proactive,
                      iterations=args.iterations,
                      max_tokens=args.max_tokens, temperature=args.temperature,
                      mode=args.mode, seed=args.seed, host=args.host, port=args.port,
                      device=args.device, jitter_ms=args.jitter_ms,
                      baselines=not args.no_baselines, transports=transports, trees=trees,
                      sources=sources,
                      json_schema=schema.spec if schema else None,
                      dtype=args.dtype, draft_device=args.draft_device,
                      assisted_draft=(default_model("draft") if not args.draft_model
                                      and draft.backend != "hf" else None),
                      stall_s=args.stall_timeout, api_rows=args.api_rows,
                      edit_set=str(args.edit_set.resolve()) if args.edit_set else None)
    raw = run_bench(cfg, progress=sys.stderr.isatty())
    written = save(raw, args.out)
    print((args.out / "bench.md").read_text())
    print(f"wrote {args.out}/{', '.join(written)}", file=sys.stderr)
    return 0

"""What `spececd bench` and `spececd bench load` run their models on: the target's device
and dtype reach every process that runs it (auto: the model's own where the device
computes it natively, float32 elsewhere),
and the default draft is the other commands' (its fastest form installed here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spececd.bench import runner
from spececd.bench.processes import resolved_dtype, server_command
from spececd.bench.runner import BenchConfig
from spececd.cli import bench as bench_cli
from spececd.cli import build_parser, options


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_server_gets_the_benchs_device_and_dtype() -> None:
    plan = BenchConfig(draft="d", target="t", prompts=[])
    assert flag(server_command(plan), "--dtype") == "auto"  # not float32 on every device
    gpu = server_command(BenchConfig(draft="d", target="t", prompts=[], device="cuda:1",
                                     dtype="float16"))
    assert (flag(gpu, "--device"), flag(gpu, "--dtype")) == ("cuda:1", "float16")


def test_auto_is_the_models_own_dtype_where_the_device_computes_it(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """The bench labels its runs with the dtype the server and the worker resolve, by the
    backend's rule (spececd.backends.dtypes): a float32 model in float32, a bfloat16 one in
    bfloat16 on a CPU that computes it and float32 on one that does not."""
    torch = pytest.importorskip("torch")
    from spececd.backends.dtypes import cpu_computes_bf16

    fp32 = str(tiny_models["llama"])
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    config = json.loads((tiny_models["llama"] / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert resolved_dtype("auto", "cpu", fp32) == "float32"
    assert resolved_dtype("bfloat16", "cpu", fp32) == "bfloat16"
    assert resolved_dtype("auto", "cpu", str(bf16)) == ("bfloat16" if cpu_computes_bf16()
                                                        else "float32")
    # on a machine without CUDA, a cuda device falls back to the CPU, and so does auto
    assert resolved_dtype("auto", "cuda", fp32) == ("bfloat16" if torch.cuda.is_available()
                                                    else "float32")


def test_the_target_alone_loads_in_the_jobs_dtype(tiny_models: dict[str, Path]) -> None:
    torch = pytest.importorskip("torch")
    from spececd.bench.worker import HFRunner

    job = {"kind": "target", "target": str(tiny_models["llama"]), "device": "cpu",
           "dtype": "bfloat16", "temperature": 0.0, "max_tokens": 3}
    alone = HFRunner(job)
    assert alone.model.dtype == torch.bfloat16
    assert alone.run("def f(x):", 0)["tokens"] == 3
    assert HFRunner({**job, "dtype": "auto"}).model.dtype == torch.float32


def test_kinds_that_load_the_same_target_share_one_copy_of_it(
        tiny_models: dict[str, Path], other_tokenizer_model: Path) -> None:
    """One worker per copy of the target: the target alone and assisted generation by each
    draft (another tokenizer's through transformers' universal assisted generation) on
    transformers' model; the bare forward and the target alone under a schema on the
    server's backend."""
    pytest.importorskip("torch")
    from spececd.bench.worker import AloneRunner, BareRunner, HFRunner, runners

    drafts = [str(tiny_models["draft"]), str(other_tokenizer_model)]
    job = {"kinds": ["target", "assisted"], "target": str(tiny_models["llama"]),
           "drafts": drafts, "device": "cpu", "dtype": "float32", "temperature": 0.0,
           "max_tokens": 3}
    made = runners(job)
    hf = made["target"]
    assert isinstance(hf, HFRunner) and made["assisted"] is hf
    assert [hf.assistants[d][1] == {} for d in drafts] == [True, False]  # the same vocabulary
    for request, assistant in (({"kind": "assisted", "draft": drafts[1]}, drafts[1]),
                               ({"kind": "target"}, None),
                               ({"kind": "assisted", "draft": drafts[0]}, drafts[0])):
        hf.configure(request)
        assert hf.assistant is (hf.assistants[assistant] if assistant else None)
        assert hf.run("def f(x):", 0)["tokens"] == 3
    both = runners({**job, "kinds": ["bare", "alone"], "positions": 2, "repeat": 1,
                    "json_schema": '{"type": "object"}'})
    assert isinstance(both["bare"], BareRunner) and isinstance(both["alone"], AloneRunner)
    assert both["bare"].backend is both["alone"].backend


@pytest.mark.parametrize("argv", [["bench"], ["bench", "load"]])
def test_both_commands_take_the_device_flags(argv: list[str]) -> None:
    args = build_parser().parse_args([*argv, "--device", "cuda", "--dtype", "bfloat16",
                                      "--draft-device", "cpu", "--stall-timeout", "30"])
    assert (args.device, args.dtype, args.draft_device, args.stall_timeout) == (
        "cuda", "bfloat16", "cpu", 30.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--dtype", "float64"])


def models(root: Path) -> Path:
    """A models/ folder with the default draft as transformers and ONNX, the target and
    prompts: names only, nothing here is loaded."""
    for name, marker in (("draft", "config.json"), ("target", "config.json"),
                         ("draft-onnx", "genai_config.json")):
        (root / name).mkdir()
        (root / name / marker).write_text("{}")
    (root / "heldout_prompts.json").write_text('["def f(x):"]')
    return root


class Planned(Exception):
    pass


@pytest.mark.parametrize(("installed", "draft", "assisted"), [
    ({"onnx", "hf"}, "draft-onnx", "draft"),  # assisted generation drafts on transformers
    ({"hf"}, "draft", None),
])
def test_the_default_draft_is_the_other_commands(
        installed: set[str], draft: str, assisted: str | None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    root = models(tmp_path)
    monkeypatch.setenv("SPECECD_MODELS", str(root))
    monkeypatch.setattr(options, "installed", lambda name: name in installed)
    planned: list[BenchConfig] = []

    def run_bench(cfg: BenchConfig, progress: bool = True) -> dict[str, object]:
        planned.append(cfg)
        raise Planned

    monkeypatch.setattr(runner, "run_bench", run_bench)
    args = build_parser().parse_args(["bench", "--out", str(tmp_path / "out")])
    with pytest.raises(Planned):
        bench_cli.run(args)
    assert planned[0].drafts == [options.choose_draft(None).model] == [str(root / draft)]
    assert planned[0].assisted_draft == (str(root / assisted) if assisted else None)


def test_a_load_curve_runs_replay_at_each_acceptance(monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    from spececd.bench import load

    args = build_parser().parse_args(["bench", "load", "--clients", "1,64", "--kind",
                                      "cloud-only,replay,draft", "--acceptance", "0.6,0.8"])
    acceptances = bench_cli.parse_list(args.acceptance, float, "--acceptance")
    monkeypatch.setattr(load, "target_traces", lambda *a: [[1, 2]] * 64)
    monkeypatch.setattr(load, "run_load", lambda url, fp, prompts, n, duration, kind, rate,
                        *rest, **kw: {"clients": n, "kind": kind, "acceptance_target": rate})
    rows = load.run_curve([("ws://x", {})], None, [[1]], [1, 64], 1.0,  # type: ignore[arg-type]
                          args.kind.split(","), acceptances, 4, 8, "draft")
    assert [(r["clients"], r["kind"], r["acceptance_target"]) for r in rows] == [
        (n, kind, rate) for n in (1, 64)
        for kind, rate in (("cloud-only", 0.6), ("replay", 0.6), ("replay", 0.8),
                           ("draft", 0.6))]

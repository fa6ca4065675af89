"""Train SpecECD's default model pair from the Python standard library's source.

Reproducible end to end on a CPU, offline:

    python models/train.py all --out models

Stages (each can be run alone, in this order):

- ``data``: collect every ``.py`` file of the running interpreter's standard library
  (``site-packages`` excluded), split *by file* into train (95%) and held-out (5%) by a
  hash of the relative path, train a byte-level BPE tokenizer on the train files only,
  and write both token streams to ``OUT/.cache``.
- ``target``: train the target Llama on the train stream (cross-entropy).
- ``draft``: train the draft Llama, first on the train stream (cross-entropy), then
  distilled from the trained target (KL(target || draft) mixed with cross-entropy), which
  raises the draft's agreement with the target.
- ``prompts``: 20 prompts cut from held-out files (``OUT/heldout_prompts.json``), used by
  ``spececd demo`` and the greedy-identity test.
- ``eval``: held-out loss of both models and their greedy agreement (share of positions
  where the draft's argmax equals the target's), written to ``OUT/metrics.json``, plus the
  loss curves in ``OUT/loss_curves.png``.

Weights are saved as bfloat16 safetensors (sharded at 16 MB) next to a copy of the shared
tokenizer, so ``AutoModelForCausalLM.from_pretrained(OUT/"target")`` loads each model.
Everything is seeded; CPU kernels are not bit-deterministic across thread counts, so a
rerun matches the committed weights closely, not bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

VOCAB_SIZE = 4096
SEQ_LEN = 256
EOS = "<|endoftext|>"
HELDOUT_PERCENT = 5

# Architecture of each model (Llama). Parameter counts are printed by the script and
# recorded in metrics.json.
ARCH: dict[str, dict[str, Any]] = {
    "target": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                   num_attention_heads=6, num_key_value_heads=6, tie_word_embeddings=False),
    "draft": dict(hidden_size=192, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=3, num_key_value_heads=3, tie_word_embeddings=True),
}
# Optimisation schedule: (steps, batch of SEQ_LEN windows, peak learning rate).
SCHEDULE = {
    "target": dict(steps=1400, batch=16, lr=1.5e-3),
    "draft_pretrain": dict(steps=700, batch=16, lr=3e-3),
    "draft_distill": dict(steps=350, batch=16, lr=1e-3),
}


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- data


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return root, files


def is_heldout(rel: str) -> bool:
    digest = hashlib.sha256(rel.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < HELDOUT_PERCENT


def read_texts(root: Path, files: list[Path]) -> tuple[list[str], list[str], list[str]]:
    train, heldout, heldout_names = [], [], []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test files are deliberately not UTF-8
        rel = path.relative_to(root).as_posix()
        if is_heldout(rel):
            heldout.append(text)
            heldout_names.append(rel)
        else:
            train.append(text)
    return train, heldout, heldout_names


def build_tokenizer(train_texts: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS,
        model_max_length=2 * SEQ_LEN,
    )


def encode_stream(tokenizer: Any, texts: list[str]) -> np.ndarray:
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.uint16)


def stage_data(out: Path) -> None:
    root, files = stdlib_files()
    train, heldout, heldout_names = read_texts(root, files)
    log(f"stdlib {root}: {len(train)} train files, {len(heldout)} held-out files")
    tokenizer = build_tokenizer(train)
    cache = out / ".cache"
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(cache / "tokenizer")
    train_ids, heldout_ids = encode_stream(tokenizer, train), encode_stream(tokenizer, heldout)
    np.save(cache / "train.npy", train_ids)
    np.save(cache / "heldout.npy", heldout_ids)
    info = {
        "python": sys.version.split()[0],
        "stdlib": str(root),
        "train_files": len(train),
        "heldout_files": len(heldout),
        "train_bytes": sum(len(t.encode()) for t in train),
        "heldout_bytes": sum(len(t.encode()) for t in heldout),
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(heldout_ids.size),
        "heldout_file_names": heldout_names,
    }
    (cache / "data.json").write_text(json.dumps(info, indent=1))
    log(f"tokens: train {train_ids.size:,}, held-out {heldout_ids.size:,}")


# ---------------------------------------------------------------------------- models


def make_model(kind: str, tokenizer: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, max_position_embeddings=2 * SEQ_LEN,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        **ARCH[kind],
    )
    return LlamaForCausalLM(config)


def n_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def windows(stream: np.ndarray, starts: np.ndarray) -> torch.Tensor:
    idx = starts[:, None] + np.arange(SEQ_LEN + 1)[None, :]
    return torch.from_numpy(stream[idx].astype(np.int64))


def heldout_batches(heldout: np.ndarray, n: int, batch: int = 16) -> list[torch.Tensor]:
    rng = np.random.default_rng(1234)
    starts = np.sort(rng.choice(heldout.size - SEQ_LEN - 1, size=n, replace=False))
    return [windows(heldout, starts[i:i + batch]) for i in range(0, n, batch)]


@torch.no_grad()
def eval_loss(model: Any, batches: list[torch.Tensor]) -> float:
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        logits = model(batch[:, :-1]).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1),
                               reduction="sum")
        total, count = total + loss.item(), count + batch[:, 1:].numel()
    model.train()
    return total / count


def lr_at(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_loop(model: Any, stream: np.ndarray, heldout: np.ndarray, phase: str, seed: int,
               log_rows: list[dict[str, Any]], teacher: Any = None,
               distill_weight: float = 0.0) -> None:
    sched = SCHEDULE[phase]
    steps, batch, peak = sched["steps"], sched["batch"], sched["lr"]
    rng = np.random.default_rng(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak, betas=(0.9, 0.95))
    eval_set = heldout_batches(heldout, 64)
    t0, tokens = time.perf_counter(), 0
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak)
        starts = rng.integers(0, stream.size - SEQ_LEN - 1, size=batch)
        xy = windows(stream, starts)
        x, y = xy[:, :-1], xy[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x).logits
            if teacher is not None:
                with torch.no_grad():
                    teacher_logits = teacher(x).logits
        logits = logits.float()
        ce = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), y.reshape(-1))
        loss = ce
        if teacher is not None:
            kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher_logits.float(), -1),
                          log_target=True, reduction="batchmean") / SEQ_LEN
            loss = (1 - distill_weight) * ce + distill_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += x.numel()
        if step % 25 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - t0
            row: dict[str, Any] = {"phase": phase, "step": step, "train_loss": round(ce.item(), 4),
                                   "tokens": tokens, "elapsed_s": round(elapsed, 1)}
            if step % 100 == 0 or step == steps - 1:
                row["heldout_loss"] = round(eval_loss(model, eval_set), 4)
            log_rows.append(row)
            log(f"{phase} step {step}/{steps} ce {ce.item():.3f} "
                f"{row.get('heldout_loss', '')} {tokens / elapsed:.0f} tok/s")


def save_model(model: Any, tokenizer: Any, path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="16MB")
    tokenizer.save_pretrained(path)
    model.float()


def load_tokenizer(out: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out / ".cache" / "tokenizer")


def load_streams(out: Path) -> tuple[np.ndarray, np.ndarray]:
    return np.load(out / ".cache" / "train.npy"), np.load(out / ".cache" / "heldout.npy")


def stage_target(out: Path, seed: int) -> None:
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(out)
    train, heldout = load_streams(out)
    model = make_model("target", tokenizer)
    log(f"target: {n_params(model):,} parameters")
    rows: list[dict[str, Any]] = []
    train_loop(model, train, heldout, "target", seed, rows)
    save_model(model, tokenizer, out / "target")
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / "target.json").write_text(json.dumps(rows))


def load_trained(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def stage_draft(out: Path, seed: int) -> None:
    torch.manual_seed(seed + 1)
    tokenizer = load_tokenizer(out)
    train, heldout = load_streams(out)
    model = make_model("draft", tokenizer)
    log(f"draft: {n_params(model):,} parameters")
    rows: list[dict[str, Any]] = []
    train_loop(model, train, heldout, "draft_pretrain", seed + 1, rows)
    teacher = load_trained(out / "target")
    train_loop(model, train, heldout, "draft_distill", seed + 2, rows, teacher=teacher,
               distill_weight=0.8)
    save_model(model, tokenizer, out / "draft")
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / "draft.json").write_text(json.dumps(rows))


@torch.no_grad()
def stage_eval(out: Path) -> None:
    target, draft = load_trained(out / "target"), load_trained(out / "draft")
    _, heldout = load_streams(out)
    batches = heldout_batches(heldout, 256)
    loss = {"target": 0.0, "draft": 0.0}
    agree, count = 0, 0
    for batch in batches:
        x, y = batch[:, :-1], batch[:, 1:].reshape(-1)
        for name, model in (("target", target), ("draft", draft)):
            logits = model(x).logits.reshape(-1, VOCAB_SIZE)
            loss[name] += F.cross_entropy(logits, y, reduction="sum").item()
            if name == "target":
                target_argmax = logits.argmax(-1)
            else:
                agree += int((logits.argmax(-1) == target_argmax).sum())
        count += y.numel()
    data = json.loads((out / ".cache" / "data.json").read_text())
    metrics = {
        "target_params": n_params(target),
        "draft_params": n_params(draft),
        "param_ratio": round(n_params(target) / n_params(draft), 2),
        "heldout_tokens_evaluated": count,
        "target_heldout_loss": round(loss["target"] / count, 4),
        "draft_heldout_loss": round(loss["draft"] / count, 4),
        "greedy_agreement": round(agree / count, 4),
        "data": {k: v for k, v in data.items() if k != "heldout_file_names"},
        "schedule": SCHEDULE,
        "arch": ARCH,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    (out / "heldout_files.json").write_text(json.dumps(data["heldout_file_names"], indent=0))
    log(json.dumps({k: v for k, v in metrics.items() if k not in ("schedule", "arch", "data")}))
    plot_curves(out)


def plot_curves(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("target", "draft"):
        rows = json.loads((out / "logs" / f"{name}.json").read_text())
        offset, last_phase, xs, train_loss, hx, hy = 0, None, [], [], [], []
        for row in rows:
            if row["phase"] != last_phase and last_phase is not None:
                offset = xs[-1]
            last_phase = row["phase"]
            xs.append(offset + row["tokens"])
            train_loss.append(row["train_loss"])
            if "heldout_loss" in row:
                hx.append(offset + row["tokens"])
                hy.append(row["heldout_loss"])
        ax.plot(np.array(xs) / 1e6, train_loss, alpha=0.4, label=f"{name} train")
        ax.plot(np.array(hx) / 1e6, hy, marker="o", ms=3, label=f"{name} held-out")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=110)


def stage_prompts(out: Path) -> None:
    """20 prompts from the held-out files, for the demo and the greedy-identity test: in
    each of 20 files spread over the held-out list, the first function definition with
    up to four lines before it and its first body line."""
    data = json.loads((out / ".cache" / "data.json").read_text())
    root, names = Path(data["stdlib"]), data["heldout_file_names"]
    prompts: list[str] = []
    for name in names:
        lines = (root / name).read_text(encoding="utf-8").splitlines(keepends=True)
        for i, line in enumerate(lines[:-1]):
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":") \
                    and lines[i + 1].strip():
                prompt = "".join(lines[max(0, i - 4):i + 2])
                if 40 <= len(prompt) <= 600:
                    prompts.append(prompt)
                    break
    step = len(prompts) / 20
    chosen = [prompts[int(i * step)] for i in range(20)]
    (out / "heldout_prompts.json").write_text(json.dumps(chosen, indent=1))
    log(f"wrote 20 prompts from {len(prompts)} candidate held-out files")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage", choices=["data", "target", "draft", "eval", "prompts", "all"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    stages = (["data", "target", "draft", "eval", "prompts"] if args.stage == "all"
              else [args.stage])
    for stage in stages:
        t0 = time.perf_counter()
        if stage == "data":
            stage_data(args.out)
        elif stage == "target":
            stage_target(args.out, args.seed)
        elif stage == "draft":
            stage_draft(args.out, args.seed)
        elif stage == "eval":
            stage_eval(args.out)
        else:
            stage_prompts(args.out)
        log(f"stage {stage} took {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

"""Train SpecECD's default model pair from Python source: the standard library and the
sources of a fixed list of pure-Python packages at pinned versions.

Reproducible end to end on a CPU:

    python models/train.py all --out models

Stages (each can be run alone, in this order):

- ``data``: collect every ``.py`` file of the running interpreter's standard library
  (``site-packages`` excluded) and of the wheels in ``PACKAGES``, downloaded from the
  package index with pip and checked against their SHA-256; split *by file* into train
  (95%) and held-out (5%) by a hash of the file's name (``stdlib/...`` or
  ``PACKAGE-VERSION/...``); train a byte-level BPE tokenizer on the train files only; write
  the token streams, and those of ``OUTSIDE`` (a package left out of the corpus, for an
  out-of-corpus measurement), to the cache.
- ``target``: train the target Llama on the train stream (cross-entropy).
- ``draft``: train the draft Llama, first on the train stream (cross-entropy), then
  distilled from the trained target (KL(target || draft) mixed with cross-entropy), which
  raises the draft's agreement with the target.
- ``prompts``: 20 prompts cut from held-out files (``OUT/heldout_prompts.json``), used by
  ``spececd demo``, the greedy-identity tests and ``spececd bench``.
- ``eval``: held-out loss of both models (per token and per byte of text) and their greedy
  agreement (the share of positions where the draft's argmax equals the target's), on the
  held-out split and on ``OUTSIDE``, written to ``OUT/metrics.json``, plus the loss curves
  in ``OUT/loss_curves.png``. ``eval --pair DIR`` measures another pair (``DIR/target``,
  ``DIR/draft``, with its own tokenizer) on the same text, into ``DIR/metrics-compare.json``.

Training is resumable: every phase writes a checkpoint (weights, optimizer, random
states, log) to the cache every ``CHECKPOINT_EVERY`` steps and at its end, and a rerun of
a stage continues from the last one. The cache (``--cache``, default
``~/.cache/spececd/train``) lives outside the repository so that a fresh checkout resumes.

Weights are saved as bfloat16 safetensors (sharded at 16 MB) next to a copy of the shared
tokenizer and the chat template ``chat_template.jinja`` (a ``Role: text`` transcript, tools
in the Hermes style Qwen2.5 uses, so that ``spececd api`` parses calls as ``hermes``), so
``AutoModelForCausalLM.from_pretrained(OUT/"target")`` loads each model.
Everything is seeded; CPU kernels are not bit-deterministic across thread counts, so a
rerun matches the committed weights closely, not bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

VOCAB_SIZE = 4096
SEQ_LEN = 256
EOS = "<|endoftext|>"
# The pair's chat template, saved into each model folder; models/README.md says how the
# converted drafts (draft-onnx, draft.gguf) carry it.
CHAT_TEMPLATE = Path(__file__).resolve().parent / "chat_template.jinja"
HELDOUT_PERCENT = 5

# Architecture of each model (Llama). Parameter counts are printed by the script and
# recorded in metrics.json.
ARCH: dict[str, dict[str, Any]] = {
    "target": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False),
    "draft": dict(hidden_size=256, intermediate_size=576, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
}
# Optimisation schedule: (steps, batch of SEQ_LEN windows, peak learning rate). Sized for
# about five hours on a 2-core CPU in all (measured here: target 2,770 tokens/s, draft
# 12,500 tokens/s, in bfloat16 autocast on 2 threads).
SCHEDULE = {
    "target": dict(steps=8400, batch=16, lr=1e-3),
    "draft_pretrain": dict(steps=3000, batch=16, lr=3e-3),
    "draft_distill": dict(steps=3000, batch=16, lr=1e-3),
}
CHECKPOINT_EVERY = 50
# The corpus beside the standard library: pure-Python wheels, pinned, with their SHA-256.
PACKAGES = {
    "requests==2.32.3": "70761cfe03c773ceb22aa2f671b4757976145175cdfca038c02654d061d6dcc6",
    "urllib3==2.2.3": "ca899ca043dcb1bafa3e262d73aa25c465bfb49e0bd9dd5d59f1d0acba2f8fac",
    "idna==3.10": "946d195a0d259cbba61165e88e65941f16e9b36ea6ddb97f00452bae8b1287d3",
    "click==8.1.7": "ae74fb96c20a0277a1d615f1e4d73c8414f5a98db8b799a7931d1582f3390c28",
    "flask==3.0.3": "34e815dfaa43340d1d15a5c3a02b8476004037eb4840b34910c6e21679d288f3",
    "werkzeug==3.0.4": "02c9eb92b7d6c06f31a782811505d2157837cea66aaede3e217c7c27c039476c",
    "jinja2==3.1.4": "bc5dd2abb727a5319567b7a813e6a2e7318c39f4f487cfe6c89c6f9c7d25197d",
    "itsdangerous==2.2.0": "c6242fc49e35958c8b15141343aa660db5fc54d4f13a1db01a3f5891b98700ef",
    "attrs==24.2.0": "81921eb96de3191c8258c199618104dd27ac608d9366f5e35d011eae1867ede2",
    "packaging==24.1": "5b8f2217dbdbd2f7f384c41c628544e6d52f2d0f53c6d0c3ea61aa5d1d7ff124",
    "pyparsing==3.1.4": "a6a7ee4235a3f944aa1fa2249307708f893fe5717dc603503c6c7969c070fb7c",
    "six==1.16.0": "8abb2f1d86890a2dfb989f9a77cfcfd3e47c2a354b01111771326f8aa26e0254",
    "docutils==0.21.2": "dafca5b9e384f0e419294eb4d2ff9fa826435bf15f15b7bd45723e8ad76811b2",
    "pygments==2.18.0": "b8e6aca0523f3ab76fee51799c488e38782ac06eafcf95e7ba832985c8e7b13a",
    "rich==13.9.2": "8c82a3d3f8dcfe9e734771313e606b39d8247bb6b826e196f4914b333b743cf1",
    "markdown-it-py==3.0.0": "355216845c60bd96232cd8d8c40e8f9765cc86f46880e43a8fd22dc1a1a8cab1",
    "networkx==3.3": "28575580c6ebdaf4505b22c6256a2b9de86b316dc63ba9e93abde3d78dfdbcf2",
    "django==5.1.2": "f11aa87ad8d5617171e3f77e1d5d16f004b79a2cf5d2e1d2b97a6a1f8e9ba5ed",
    "setuptools==75.1.0": "35ab7fd3bcd95e6b7fd704e4a1539513edad446c097797f2985e0e4b960772f2",
    "pip==24.2": "2cd581cf58ab7fcfca4ce8efa6dcacd0de5bf8d0a3eb9ec927e07405f4d9e2a2",
    "pytest==8.3.3": "a6853c7375b2663155079443d2e45de913a911a11d669df02a50814944db57b2",
    "pluggy==1.5.0": "44e1ad92c8ca002de6377e165f3e0f1be63266ab4d554740532335b9d75ea669",
    "hypothesis==6.112.2": "914b55f75b7c6f653cd36fef66b61a773a51c1e363939fcbc0216773ff4ee0d9",
    "twisted==24.7.0": "734832ef98108136e222b5230075b1079dad8a3fc5637319615619a7725b0c81",
}
# Python from a package outside the corpus: the out-of-corpus agreement is measured on it.
OUTSIDE = {
    "boltons==24.0.0": "9618695a6ec4f50412e7072e5d78910a00b4111d0b9b549e4a3d60bc321e7807",
}


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- data


def stdlib_texts() -> tuple[Path, dict[str, str]]:
    """Every UTF-8 ``.py`` file of the standard library, by ``stdlib/RELATIVE/PATH``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = {}
    for path in sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts):
        try:
            texts[f"stdlib/{path.relative_to(root).as_posix()}"] = path.read_text("utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test files are deliberately not UTF-8
    return root, texts


def wheel_texts(requirement: str, sha256: str, cache: Path) -> dict[str, str]:
    """Every UTF-8 ``.py`` file of a pinned wheel, by ``NAME-VERSION/PATH``. The wheel is
    downloaded once (pip, no dependencies) and must match its SHA-256."""
    name, version = requirement.split("==")
    folder = cache / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    found = [p for p in folder.glob("*.whl") if _sha256(p) == sha256]
    if not found:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                            "--only-binary=:all:", requirement, "-d", tmp], check=True)
            (wheel,) = Path(tmp).glob("*.whl")
            if _sha256(wheel) != sha256:
                raise SystemExit(f"{wheel.name}: SHA-256 {_sha256(wheel)} is not the pinned "
                                 f"{sha256}")
            found = [Path(shutil.copy(wheel, folder / wheel.name))]
    texts = {}
    with zipfile.ZipFile(found[0]) as archive:
        for info in sorted(archive.infolist(), key=lambda i: i.filename):
            if info.filename.endswith(".py"):
                try:
                    texts[f"{name}-{version}/{info.filename}"] = archive.read(info).decode()
                except UnicodeDecodeError:
                    continue
    return texts


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def is_heldout(name: str) -> bool:
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < HELDOUT_PERCENT


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


def stage_data(out: Path, cache: Path) -> None:
    done = cache / "data.json"
    if done.is_file() and json.loads(done.read_text()).get("packages") == PACKAGES:
        log(f"data: already in {cache} (the checkpoints there depend on its tokenizer)")
        return
    root, texts = stdlib_texts()
    sources: dict[str, dict[str, Any]] = {
        "stdlib": {"files": len(texts), "bytes": sum(len(t.encode()) for t in texts.values())}}
    for requirement, sha256 in PACKAGES.items():
        found = wheel_texts(requirement, sha256, cache)
        sources[requirement] = {"sha256": sha256, "files": len(found),
                                "bytes": sum(len(t.encode()) for t in found.values())}
        texts.update(found)
    train = {name: text for name, text in texts.items() if not is_heldout(name)}
    heldout = {name: text for name, text in texts.items() if is_heldout(name)}
    outside = {}
    for requirement, sha256 in OUTSIDE.items():
        outside.update(wheel_texts(requirement, sha256, cache))
    log(f"{len(sources)} sources: {len(train)} train files, {len(heldout)} held-out files; "
        f"outside the corpus: {len(outside)} files")
    tokenizer = build_tokenizer(list(train.values()))
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(cache / "tokenizer")
    streams = {"train": encode_stream(tokenizer, list(train.values())),
               "heldout": encode_stream(tokenizer, list(heldout.values())),
               "outside": encode_stream(tokenizer, list(outside.values()))}
    for name, ids in streams.items():
        np.save(cache / f"{name}.npy", ids)
    (cache / "heldout_texts.json").write_text(json.dumps(heldout))
    (cache / "outside_texts.json").write_text(json.dumps(outside))
    info = {
        "python": sys.version.split()[0],
        "stdlib": str(root),
        "sources": sources,
        "packages": PACKAGES,
        "outside": list(OUTSIDE),
        "train_files": len(train),
        "heldout_files": len(heldout),
        "outside_files": len(outside),
        "train_bytes": sum(len(t.encode()) for t in train.values()),
        "heldout_bytes": sum(len(t.encode()) for t in heldout.values()),
        "outside_bytes": sum(len(t.encode()) for t in outside.values()),
        "train_tokens": int(streams["train"].size),
        "heldout_tokens": int(streams["heldout"].size),
        "outside_tokens": int(streams["outside"].size),
        "heldout_file_names": sorted(heldout),
    }
    (cache / "data.json").write_text(json.dumps(info, indent=1))
    log(f"tokens: train {streams['train'].size:,}, held-out {streams['heldout'].size:,}, "
        f"outside {streams['outside'].size:,}")


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
               checkpoint: Path, teacher: Any = None,
               distill_weight: float = 0.0) -> list[dict[str, Any]]:
    """Train ``model`` for the phase's schedule, resuming from ``checkpoint`` when it holds
    an unfinished run of this phase; return the log rows."""
    sched = SCHEDULE[phase]
    steps, batch, peak = sched["steps"], sched["batch"], sched["lr"]
    rng = np.random.default_rng(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak, betas=(0.9, 0.95))
    eval_set = heldout_batches(heldout, 64)
    start, tokens, spent, rows = 0, 0, 0.0, []
    if checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        rng.bit_generator.state = state["rng"]
        torch.set_rng_state(state["torch_rng"])
        start, tokens = state["step"] + 1, state["tokens"]
        spent, rows = state["spent"], state["rows"]
        log(f"{phase}: resuming at step {start}/{steps} ({spent / 3600:.2f} h so far)")
    t0 = time.perf_counter()
    model.train()
    for step in range(start, steps):
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
        last = step == steps - 1
        if step % 25 == 0 or last:
            elapsed = spent + time.perf_counter() - t0
            row: dict[str, Any] = {"phase": phase, "step": step, "train_loss": round(ce.item(), 4),
                                   "tokens": tokens, "elapsed_s": round(elapsed, 1)}
            if step % 100 == 0 or last:
                row["heldout_loss"] = round(eval_loss(model, eval_set), 4)
            rows.append(row)
            speed = (step + 1 - start) * batch * SEQ_LEN / (time.perf_counter() - t0)
            log(f"{phase} step {step}/{steps} ce {ce.item():.3f} "
                f"{row.get('heldout_loss', '')} {speed:.0f} tok/s")
        if step % CHECKPOINT_EVERY == CHECKPOINT_EVERY - 1 or last:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                     "rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(),
                     "step": step, "tokens": tokens, "rows": rows,
                     "spent": spent + time.perf_counter() - t0}
            torch.save(state, checkpoint.with_suffix(".tmp"))
            os.replace(checkpoint.with_suffix(".tmp"), checkpoint)
    return rows


def save_model(model: Any, tokenizer: Any, path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="16MB")
    # The conversation format, tools included (saved as chat_template.jinja): see
    # CHAT_TEMPLATE. The tokenizer's vocabulary, and so its fingerprint, is unchanged.
    tokenizer.chat_template = CHAT_TEMPLATE.read_text()
    tokenizer.save_pretrained(path)
    model.float()


def load_tokenizer(cache: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cache / "tokenizer")


def load_stream(cache: Path, name: str) -> np.ndarray:
    return np.load(cache / f"{name}.npy")


def checkpoint(cache: Path, phase: str, seed: int) -> Path:
    """Where a phase's run keeps its checkpoint: one per seed and schedule."""
    return cache / f"{phase}-seed{seed}-{SCHEDULE[phase]['steps']}steps.ckpt"


def stage_target(out: Path, cache: Path, seed: int) -> None:
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(cache)
    model = make_model("target", tokenizer)
    log(f"target: {n_params(model):,} parameters")
    rows = train_loop(model, load_stream(cache, "train"), load_stream(cache, "heldout"),
                      "target", seed, checkpoint(cache, "target", seed))
    save_model(model, tokenizer, out / "target")
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / "target.json").write_text(json.dumps(rows))


def load_trained(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def stage_draft(out: Path, cache: Path, seed: int) -> None:
    torch.manual_seed(seed + 1)
    tokenizer = load_tokenizer(cache)
    train, heldout = load_stream(cache, "train"), load_stream(cache, "heldout")
    model = make_model("draft", tokenizer)
    log(f"draft: {n_params(model):,} parameters")
    rows = train_loop(model, train, heldout, "draft_pretrain", seed + 1,
                      checkpoint(cache, "draft_pretrain", seed))
    teacher = load_trained(out / "target")
    rows += train_loop(model, train, heldout, "draft_distill", seed + 2,
                       checkpoint(cache, "draft_distill", seed), teacher=teacher,
                       distill_weight=0.8)
    save_model(model, tokenizer, out / "draft")
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / "draft.json").write_text(json.dumps(rows))


@torch.no_grad()
def measure(target: Any, draft: Any, stream: np.ndarray, bytes_per_token: float
            ) -> dict[str, float]:
    """Losses of both models (nats per token and per byte of text) and their greedy
    agreement over 256 windows of ``stream``."""
    loss = {"target": 0.0, "draft": 0.0}
    agree, count = 0, 0
    vocab = target.config.vocab_size
    for batch in heldout_batches(stream, 256):
        x, y = batch[:, :-1], batch[:, 1:].reshape(-1)
        target_logits = target(x).logits.reshape(-1, vocab)
        draft_logits = draft(x).logits.reshape(-1, vocab)
        loss["target"] += F.cross_entropy(target_logits, y, reduction="sum").item()
        loss["draft"] += F.cross_entropy(draft_logits, y, reduction="sum").item()
        agree += int((draft_logits.argmax(-1) == target_logits.argmax(-1)).sum())
        count += y.numel()
    return {"positions": count,
            "target_loss": round(loss["target"] / count, 4),
            "draft_loss": round(loss["draft"] / count, 4),
            "target_loss_per_byte": round(loss["target"] / count / bytes_per_token, 4),
            "draft_loss_per_byte": round(loss["draft"] / count / bytes_per_token, 4),
            "greedy_agreement": round(agree / count, 4)}


def measure_pair(pair: Path, cache: Path) -> dict[str, dict[str, float]]:
    """``measure`` on the held-out split and on the package outside the corpus, each as
    the pair's own tokenizer encodes the text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair / "target")
    target, draft = load_trained(pair / "target"), load_trained(pair / "draft")
    results = {}
    for split in ("heldout", "outside"):
        texts = list(json.loads((cache / f"{split}_texts.json").read_text()).values())
        stream = encode_stream(tokenizer, texts)
        results[split] = measure(target, draft, stream,
                                 sum(len(t.encode()) for t in texts) / stream.size)
    return results


def stage_eval(out: Path, cache: Path, pair: Path | None = None) -> None:
    if pair is not None:
        results = measure_pair(pair, cache)
        (pair / "metrics-compare.json").write_text(json.dumps(results, indent=1))
        log(json.dumps(results))
        return
    results = measure_pair(out, cache)
    target, draft = load_trained(out / "target"), load_trained(out / "draft")
    data = json.loads((cache / "data.json").read_text())
    seen = {name: json.loads((out / "logs" / f"{name}.json").read_text())
            for name in ("target", "draft")}
    metrics = {
        "target_params": n_params(target),
        "draft_params": n_params(draft),
        "param_ratio": round(n_params(target) / n_params(draft), 2),
        "target_heldout_loss": results["heldout"]["target_loss"],
        "draft_heldout_loss": results["heldout"]["draft_loss"],
        "greedy_agreement": results["heldout"]["greedy_agreement"],
        "outside_greedy_agreement": results["outside"]["greedy_agreement"],
        "heldout": results["heldout"],
        "outside": results["outside"],
        "tokens_seen": {name: sum(max(r["tokens"] for r in rows if r["phase"] == phase)
                                  for phase in {r["phase"] for r in rows})
                        for name, rows in seen.items()},
        "training_hours": {name: round(sum(max(r["elapsed_s"] for r in rows
                                               if r["phase"] == phase)
                                           for phase in {r["phase"] for r in rows}) / 3600, 2)
                           for name, rows in seen.items()},
        "data": {k: v for k, v in data.items() if k != "heldout_file_names"},
        "schedule": SCHEDULE,
        "arch": ARCH,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    (out / "heldout_files.json").write_text(json.dumps(data["heldout_file_names"], indent=0))
    log(json.dumps({k: v for k, v in metrics.items()
                    if k not in ("schedule", "arch", "data", "heldout", "outside")}))
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


def stage_prompts(out: Path, cache: Path) -> None:
    """20 prompts from the held-out files, for the demo and the greedy-identity test: in
    each of 20 files spread over the held-out list, the first function definition with
    up to four lines before it and its first body line."""
    texts = json.loads((cache / "heldout_texts.json").read_text())
    prompts: list[str] = []
    for name in sorted(texts):
        lines = texts[name].splitlines(keepends=True)
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
    parser.add_argument("stage", choices=["data", "target", "draft", "prompts", "eval", "all"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--cache", type=Path,
                        default=Path.home() / ".cache" / "spececd" / "train",
                        help="downloaded wheels, token streams and checkpoints "
                        "(default: ~/.cache/spececd/train)")
    parser.add_argument("--pair", type=Path, help="eval: measure this pair instead")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every phase's steps (a quick check of the script: "
                        "--scale 0.002 --cache /tmp/x --out /tmp/y)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for phase in SCHEDULE.values():
        phase["steps"] = max(2, round(phase["steps"] * args.scale))
    stages = (["data", "target", "draft", "prompts", "eval"] if args.stage == "all"
              else [args.stage])
    for stage in stages:
        t0 = time.perf_counter()
        if stage == "data":
            stage_data(args.out, args.cache)
        elif stage == "target":
            stage_target(args.out, args.cache, args.seed)
        elif stage == "draft":
            stage_draft(args.out, args.cache, args.seed)
        elif stage == "prompts":
            stage_prompts(args.out, args.cache)
        else:
            stage_eval(args.out, args.cache, args.pair)
        log(f"stage {stage} took {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

"""A draft behind another tokenizer, for measuring drafting across two tokenizers: the
same model with its vocabulary permuted (every token keeps its string and merges, under
another id; the embedding rows move with it). Its predictions in text are the original
draft's, so the benchmark's cross-tokenizer row differs from the same-tokenizer row only
by what re-tokenizing costs.

    python -m spececd.bench.permute models/draft /tmp/draft-permuted
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def permute(source: Path, out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    width = int(model.get_input_embeddings().weight.shape[0])
    new = np.random.default_rng(seed).permutation(width)  # old id -> new id

    def move(token: int | None) -> int | None:
        return None if token is None else int(new[token])

    with torch.no_grad():
        weights = {id(w): w for w in (model.get_input_embeddings().weight,
                                      model.get_output_embeddings().weight)}
        for weight in weights.values():  # once each: tied embeddings share one
            weight[torch.as_tensor(new)] = weight.clone()
    for config in (model.config, model.generation_config):
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(config, name, None)
            if isinstance(value, list):
                setattr(config, name, [move(v) for v in value])
            elif isinstance(value, int):
                setattr(config, name, move(value))
    model.save_pretrained(out)
    with tempfile.TemporaryDirectory() as folder:
        AutoTokenizer.from_pretrained(source).save_pretrained(folder)
        data: dict[str, Any] = json.loads((Path(folder) / "tokenizer.json").read_text())
        data["model"]["vocab"] = {t: move(i) for t, i in data["model"]["vocab"].items()}
        for added in data.get("added_tokens") or []:
            added["id"] = move(added["id"])
        for special in ((data.get("post_processor") or {}).get("special_tokens") or {}).values():
            special["ids"] = [move(i) for i in special["ids"]]
        (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
        config_path = Path(folder) / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        if "added_tokens_decoder" in config:
            config["added_tokens_decoder"] = {
                str(move(int(i))): v for i, v in config["added_tokens_decoder"].items()}
        (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
        for extra in Path(folder).iterdir():
            if not (out / extra.name).exists():
                (out / extra.name).write_bytes(extra.read_bytes())
    return out


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m spececd.bench.permute SOURCE_MODEL OUT_FOLDER")
    print(permute(Path(sys.argv[1]), Path(sys.argv[2])))


if __name__ == "__main__":
    main()

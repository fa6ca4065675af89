"""A cost-scaled stand-in for a large target: a copy of a Llama-architecture (or Qwen2) model
that gives the same logits at the cost of a model of ``layers`` x ``intermediate``.

No weights can be downloaded here, yet the regime an 8B-class target lives in (a step of
hundreds of milliseconds on a CPU, a draft step under 1% of it) is the one speculation is
built for. The copy keeps the original's text, and so a draft's agreement with it, while a
forward costs what the larger model's does:

- the original's layers keep their weights, their MLPs padded with zero neurons up to
  ``intermediate`` (a zero row of the gate and up projections and a zero column of the down
  projection add exactly nothing);
- the layers added after them have their attention's output projection and the MLP's down
  projection all zero, so they add nothing to the residual stream, but cost a full layer's
  weights, memory traffic and kernels (their other weights are random, one block of each
  shape shared by all, since drawing billions of fresh numbers would take minutes).

Written in safetensors shards (at most ~2 GB each) in the original's stored dtype, with its
tokenizer files; ``spececd convert --to gguf --quant q8_0`` makes the GGUF a llama.cpp
verifier loads (``scripts/make-standin.py`` does both, and the draft in Q4_K_M).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from spececd.errors import InputError

log = logging.getLogger(__name__)

SHARD_BYTES = 2_000_000_000
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "generation_config.json", "tokenizer.model")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def scale_target(source: Path, out: Path, layers: int, intermediate: int) -> int:
    """Write the stand-in of the model folder ``source`` to ``out`` (see the module
    docstring); the number of parameters it has."""
    config = json.loads((source / "config.json").read_text())
    if config.get("model_type") not in ("llama", "qwen2", "mistral"):
        raise InputError(f"{source}: a {config.get('model_type')!r} model; the stand-in "
                         "is made from Llama-architecture models (llama, qwen2, mistral)")
    own_layers, own_inter = config["num_hidden_layers"], config["intermediate_size"]
    hidden = config["hidden_size"]
    if layers < own_layers or intermediate < own_inter:
        raise InputError(f"a stand-in is larger than its model ({own_layers} layers x "
                         f"{own_inter}): got {layers} x {intermediate}")
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(source.glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    if not weights:
        raise InputError(f"{source}: no safetensors weights")
    dtype = next(iter(weights.values())).dtype
    rng = torch.Generator().manual_seed(0)
    filler: dict[tuple[int, ...], torch.Tensor] = {}

    def fill(shape: tuple[int, ...]) -> torch.Tensor:
        if shape not in filler:
            filler[shape] = (torch.randn(shape, generator=rng) * 0.02).to(dtype)
        return filler[shape]

    new = {k: t for k, t in weights.items() if not k.startswith("model.layers.")}
    for i in range(layers):
        at = f"model.layers.{i}."
        gate = torch.zeros(intermediate, hidden, dtype=dtype)
        up = torch.zeros(intermediate, hidden, dtype=dtype)
        down = torch.zeros(hidden, intermediate, dtype=dtype)
        if i < own_layers:
            new.update({k: t for k, t in weights.items()
                        if k.startswith(at) and ".mlp." not in k})
            gate[:own_inter] = weights[at + "mlp.gate_proj.weight"]
            up[:own_inter] = weights[at + "mlp.up_proj.weight"]
            down[:, :own_inter] = weights[at + "mlp.down_proj.weight"]
        else:  # a full layer's cost, nothing added to the residual stream
            first = "model.layers.0."
            for name in ATTENTION:
                like = weights[f"{first}self_attn.{name}.weight"]
                new[f"{at}self_attn.{name}.weight"] = (torch.zeros_like(like) if name == "o_proj"
                                                       else fill(tuple(like.shape)))
            for key, tensor in weights.items():  # norms, attention biases (Qwen2)
                rest = key[len(first):]
                if key.startswith(first) and (rest.endswith("layernorm.weight")
                                              or rest.endswith("_proj.bias")):
                    new[at + rest] = (torch.zeros_like(tensor) if rest.endswith("_proj.bias")
                                      else tensor.clone())
            gate = up = fill((intermediate, hidden))
        new[at + "mlp.gate_proj.weight"] = gate
        new[at + "mlp.up_proj.weight"] = up
        new[at + "mlp.down_proj.weight"] = down
    _save(new, out)
    config.update(num_hidden_layers=layers, intermediate_size=intermediate)
    if isinstance(config.get("layer_types"), list):  # one per layer (Qwen2's attention kinds)
        kinds = config["layer_types"]
        config["layer_types"] = kinds + [kinds[-1]] * (layers - len(kinds))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in COPIED:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return sum(t.numel() for t in new.values())


def _save(weights: dict[str, torch.Tensor], out: Path) -> None:
    """``weights`` as safetensors shards of at most :data:`SHARD_BYTES`, with their index."""
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    seen: set[int] = set()  # safetensors stores no tensor twice: a shared block is copied
    for key, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        tensor = tensor.contiguous()
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        shards[-1][key] = tensor
        size += nbytes
    index: dict[str, object] = {"metadata": {"total_size": sum(
        t.numel() * t.element_size() for t in weights.values())}, "weight_map": {}}
    for j, shard in enumerate(shards):
        name = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(shard, name))  # type: ignore[attr-defined]
    (out / "model.safetensors.index.json").write_text(json.dumps(index))

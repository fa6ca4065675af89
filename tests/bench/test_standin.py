"""The cost-scaled stand-in (spececd.bench.standin): a copy of a model with more layers and
wider MLPs that gives the original's logits, so its text and a draft's agreement are the
original's while a forward costs the larger model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from spececd.bench.standin import scale_target  # noqa: E402
from spececd.errors import InputError  # noqa: E402
from tests.reference import PROMPTS, hf_greedy  # noqa: E402


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_scaled_copy_gives_the_originals_logits_and_greedy_text(
        arch: str, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, out = tiny_models[arch], tmp_path / "standin"
    config = json.loads((source / "config.json").read_text())
    layers, inter = config["num_hidden_layers"] + 2, 3 * config["intermediate_size"]
    n = scale_target(source, out, layers, inter)
    scaled = json.loads((out / "config.json").read_text())
    assert (scaled["num_hidden_layers"], scaled["intermediate_size"]) == (layers, inter)
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    copy = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert n == sum(p.numel() for p in copy.parameters()) > sum(
        p.numel() for p in original.parameters())
    ids = torch.tensor([[5, 17, 42, 99, 3, 8, 13]])
    with torch.no_grad():
        assert torch.allclose(original(ids).logits, copy(ids).logits, atol=1e-5)
    # An added layer that wrote to the residual stream would change them (the bug planted):
    layer = copy.model.layers[-1]
    with torch.no_grad():
        layer.self_attn.o_proj.weight.fill_(0.01)
        assert not torch.allclose(original(ids).logits, copy(ids).logits, atol=1e-3)
    tokenizer = AutoTokenizer.from_pretrained(out)  # the original's, copied
    for prompt in PROMPTS[:2]:
        prompt_ids = tokenizer.encode(prompt)
        assert hf_greedy(out, prompt_ids, 16) == hf_greedy(source, prompt_ids, 16)


def test_a_smaller_stand_in_or_another_architecture_is_refused(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(InputError, match="larger than its model"):
        scale_target(tiny_models["llama"], tmp_path / "small", 1, 8)
    with pytest.raises(InputError, match="Llama-architecture"):
        scale_target(tiny_models["gpt2"], tmp_path / "gpt2", 4, 512)

"""The transformers backend on whichever transformers is installed: 5.19 (vLLM's CPU build
pins it, so the test install has it) names the KV cache ``past_key_values``; 5.24 (what
the README's first command resolves) names it ``cache`` and warns on every forward pass
that uses the old name. ``.ci/run`` runs this module in both environments."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from spececd.backends.base import Extend  # noqa: E402
from spececd.backends.hf import HFBackend, cache_keyword  # noqa: E402


def test_the_cache_keyword_is_the_one_the_forward_takes() -> None:
    class Renamed(torch.nn.Module):
        def forward(self, input_ids: Any = None, cache: Any = None, **kwargs: Any) -> None: ...

    class Before(torch.nn.Module):
        def forward(self, input_ids: Any = None, past_key_values: Any = None,
                    **kwargs: Any) -> None: ...

    assert cache_keyword(Renamed()) == "cache"
    assert cache_keyword(Before()) == "past_key_values"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_forward_passes_use_the_installed_name_for_the_cache(
        arch: str, tiny_models: dict[str, Path]) -> None:
    backend = HFBackend(str(tiny_models[arch]), device="cpu", dtype="float32")
    # The output's field has the name the input took: a model returning it under the other
    # name would leave extend reading a cache the forward did not fill.
    with torch.inference_mode():
        out = backend.model(input_ids=torch.tensor([[1, 2]]), use_cache=True)
    assert backend.cache_keyword in list(out.keys())  # `in out` maps the old name on 5.24
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 5.24's FutureWarning for `past_key_values`
        one, two = backend.new_sequence(), backend.new_sequence()
        one.extend([1, 2, 3])
        one.extend([4, 5, 6], parents=[-1, 0, 0])  # a tree: its own attention mask
        two.extend([7])
        backend.extend_batch([Extend(one, [8, 9], 1), Extend(two, [10], 1)])


def test_a_model_with_sliding_windows_batches_item_by_item(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A batched pass runs on one 4D mask for every layer, which a sliding-window layer
    would not honour; such a model extends its batch's sequences one by one, with
    transformers' own cache and masks, and gives what separate extends give."""
    import json
    import shutil

    folder = tmp_path / "windowed"
    shutil.copytree(tiny_models["qwen2"], folder)
    config = json.loads((folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config.update(use_sliding_window=True, sliding_window=8, max_window_layers=0,
                  layer_types=["sliding_attention"] * layers)
    (folder / "config.json").write_text(json.dumps(config))
    windowed = HFBackend(str(folder), device="cpu", dtype="float32")
    assert not windowed.full_attention
    assert HFBackend(str(tiny_models["qwen2"]), device="cpu", dtype="float32").full_attention
    prompts = [list(range(5, 25)), list(range(30, 42))]
    alone = []
    for prompt in prompts:
        sequence = windowed.new_sequence()
        alone.append(sequence.extend(prompt, len(prompt)))
    batched = windowed.extend_batch([Extend(windowed.new_sequence(), tuple(p), len(p))
                                     for p in prompts])
    for one, other in zip(alone, batched, strict=True):
        assert abs(one - other).max() < 1e-4

"""The transformers backend on whichever transformers is installed: 5.19 (vLLM's CPU build
pins it, so the test install has it) names the KV cache ``past_key_values``; 5.24 (what
the README's first command resolves) names it ``cache`` and warns on every forward pass
that uses the old name. ``.ci/run`` runs this module in both environments."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
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


def test_a_batch_reuses_its_scratch_and_what_was_left_there_never_leaks(
        tiny_models: dict[str, Path]) -> None:
    """A batched pass gathers the rows' caches into the backend's scratch, kept from pass
    to pass. Rows of unequal contexts leave left padding that attention masks out; left
    as whatever the last pass wrote (here NaN, planted), it would still poison the
    logits (0 x NaN), so the pass zeroes it: the batch gives what separate extends give."""
    backend = HFBackend(str(tiny_models["llama"]), device="cpu", dtype="float32")
    assert backend.padded
    contexts, new = [list(range(3, 40)), list(range(50, 56)), []], [[7, 8, 9], [10], [11, 12]]
    alone, rows = [], []
    for context, ids in zip(contexts, new, strict=True):
        one, two = backend.new_sequence(), backend.new_sequence()
        if context:
            one.extend(context, 0)
            two.extend(context, 0)
        alone.append(one.extend(ids, len(ids)))
        rows.append(Extend(two, ids, len(ids)))
    backend.extend_batch(rows)  # the scratch is made...
    with torch.inference_mode():
        backend._scratch.fill_(float("nan"))  # ...and left dirty
    for item in rows:
        item.sequence.truncate(len(item.sequence.tokens) - len(item.ids))
    scratch = backend._scratch.data_ptr()
    batched = backend.extend_batch(rows)
    assert backend._scratch.data_ptr() == scratch  # the same scratch, NaN and all
    for one, other in zip(alone, batched, strict=True):
        assert np.isfinite(other).all() and abs(one - other).max() < 1e-4

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

"""What every backend declares (``base.Backend``): a description, the KV cache one token of
context costs, and ``extend_batch``, whose results equal separate ``extend`` calls.

Each runtime loads the shipped draft model: ``models/draft`` in transformers (float32) and
``models/draft.gguf`` in llama.cpp (KV cache in f16). ``kv_bytes_per_token`` is checked
against the model's shape from its ``config.json`` and, for transformers, against the bytes
its cache holds. Tolerance for batched against separate extends: as in test_conformance.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from spececd.backends.base import Backend, Extend  # noqa: E402
from spececd.backends.registry import load_backend  # noqa: E402
from tests.builders import MODELS  # noqa: E402
from tests.reference import LOGIT_TOLERANCE as TOLERANCE  # noqa: E402

DRAFT = MODELS / "draft"
KV_ELEMENT_BYTES = {"hf": 4, "llama.cpp": 2}  # float32 weights and cache; llama.cpp's f16


@pytest.fixture(scope="module", params=["hf", "llama.cpp"])
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "llama.cpp":
        pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
        return load_backend(str(MODELS / "draft.gguf"), threads=1)
    return load_backend(str(DRAFT), device="cpu", dtype="float32")


def test_every_backend_describes_itself(backend: Backend) -> None:
    assert isinstance(backend.description, str)
    assert DRAFT.name in backend.description  # names the model, not only the runtime


def test_kv_bytes_per_token_follows_the_model_shape(backend: Backend) -> None:
    config = json.loads((DRAFT / "config.json").read_text())
    per_element = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] \
        * config["head_dim"]  # keys and values: 2 * 4 layers * 3 KV heads * 64 here
    assert backend.kv_bytes_per_token == per_element * KV_ELEMENT_BYTES[backend.name]


@pytest.mark.parametrize(("arch", "expected"), [
    # keys and values * 2 layers * KV heads * head width (64 / 4 heads) * float32
    ("llama", 2 * 2 * 2 * 16 * 4),  # 2 KV heads shared by the 4 query heads
    ("qwen2", 2 * 2 * 2 * 16 * 4),
    ("gpt2", 2 * 2 * 4 * 16 * 4),  # no grouped-query attention: 4 KV heads
])
def test_hf_kv_bytes_per_token_is_what_its_cache_holds(arch: str, expected: int,
                                                       tiny_models: dict[str, Path]) -> None:
    backend = load_backend(str(tiny_models[arch]), device="cpu", dtype="float32")
    assert backend.kv_bytes_per_token == expected
    seq = backend.new_sequence()
    seq.extend(list(range(10)), keep=0)
    cache = seq._cache  # type: ignore[attr-defined]
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert held == 10 * expected


ExtendBatch = Callable[[Backend, Sequence[Extend]],
                      list[np.ndarray]]


@pytest.mark.parametrize("extend_batch", [
    pytest.param(lambda backend, items: backend.extend_batch(items), id="own"),
    pytest.param(Backend.extend_batch, id="default"),  # the loop a backend inherits
])
def test_extend_batch_equals_separate_extends(backend: Backend,
                                              extend_batch: ExtendBatch) -> None:
    rng = np.random.default_rng(5)
    streams = [[int(t) for t in rng.integers(0, backend.vocab_size, size=30)] for _ in range(3)]
    batched = [backend.new_sequence() for _ in streams]
    separate = [backend.new_sequence() for _ in streams]
    for seq, stream, n in zip([*batched, *separate], streams * 2, [0, 4, 11] * 2, strict=True):
        if n:
            seq.extend(stream[:n], keep=0)
    for _ in range(2):
        adds = [int(rng.integers(1, 5)) for _ in streams]
        keeps = [int(rng.integers(0, add + 1)) for add in adds]
        spans = [stream[len(seq.tokens):len(seq.tokens) + add]
                 for seq, stream, add in zip(batched, streams, adds, strict=True)]
        results = extend_batch(backend, [Extend(*item) for item in zip(batched, spans, keeps,
                                                                   strict=True)])
        for seq, alone, ids, keep, logits in zip(batched, separate, spans, keeps, results,
                                                 strict=True):
            expected = alone.extend(ids, keep)
            assert logits.shape == expected.shape == (keep, backend.vocab_size)
            np.testing.assert_allclose(logits, expected, rtol=0, atol=TOLERANCE)
            assert seq.tokens == alone.tokens


def test_hf_extend_batch_refuses_another_backends_sequences(
        tiny_models: dict[str, Path]) -> None:
    ours, theirs = (load_backend(str(tiny_models["llama"]), device="cpu", dtype="float32")
                    for _ in range(2))
    with pytest.raises(TypeError, match="made by this backend"):
        ours.extend_batch([Extend(ours.new_sequence(), [1, 2], 1),
                           Extend(theirs.new_sequence(), [3], 1)])

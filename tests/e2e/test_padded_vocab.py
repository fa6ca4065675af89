"""Pairs that share a tokenizer but pad their logits to different widths, as Qwen2.5-0.5B
(151,936) and Qwen2.5-7B (152,064) do over one 151,665-token tokenizer: compatible, and
the padded ids are never drafted, accepted or sampled. Random-init Qwen2 pairs, both
orientations (the draft narrower, as Qwen2.5 0.5B/7B, and wider), in-process and over
the network: greedy output equals the target alone with the padding masked, and sampled
output keeps the target's distribution (chi-square)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from spececd.backends.base import tokenizer_fingerprint  # noqa: E402
from spececd.backends.registry import load_backend  # noqa: E402
from spececd.core.params import SamplingParams  # noqa: E402
from spececd.generator import Generator  # noqa: E402
from tests.builders import build_model, vocab_pair  # noqa: E402
from tests.chisq import PAIR_DRAWS, chi_square_p  # noqa: E402
from tests.e2e.server import ServerProcess  # noqa: E402
from tests.reference import exact_pair_distribution  # noqa: E402

TOKENS = 512  # the session tokenizer's length
# (target width, draft width): the draft narrower, like Qwen2.5-0.5B against -7B, and wider.
WIDTHS = {"narrow-draft": (TOKENS + 128, TOKENS + 16), "wide-draft": (TOKENS + 16, TOKENS + 128)}
WORD_WIDTHS = {"narrow-draft": (26, 13), "wide-draft": (13, 26)}  # over 11 tokens
PROMPTS = ["def parse(line):\n    ", "import os\n\nclass ", "    for key, value in "]


@pytest.fixture(scope="module")
def padded(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any
           ) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("padded")
    pairs = {}
    for name, (target_width, draft_width) in WIDTHS.items():
        pairs[name] = {
            "target": build_model("qwen2", root / name / "target", tokenizer, seed=20,
                                  width=target_width),
            "draft": build_model("qwen2", root / name / "draft", tokenizer, seed=21, layers=1,
                                 hidden=32, width=draft_width)}
    return pairs


class Servers:
    """One `spececd serve` per target, started when first asked for, stopped at the end."""

    def __init__(self) -> None:
        self.running: dict[Path, ServerProcess] = {}

    def url_for(self, target: Path, where: str) -> str | None:
        if where == "memory":
            return None
        if target not in self.running:
            self.running[target] = ServerProcess(target)
        return self.running[target].url


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    made = Servers()
    yield made
    for proc in made.running.values():
        proc.stop()


@pytest.fixture(scope="module")
def word_pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("padded-words")
    return {name: vocab_pair(root / name, "qwen2", widths)
            for name, widths in WORD_WIDTHS.items()}


WHERE = ["memory", "websocket"]


def masked_greedy(model_dir: Path, ids: list[int], n: int, mask: bool = True) -> list[int]:
    """transformers' own greedy continuation; ``mask``: with the padded ids suppressed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = model.get_output_embeddings().weight.shape[0]
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0,
                         suppress_tokens=list(range(TOKENS, width)) if mask else None)
    return out[0, len(ids):].tolist()  # type: ignore[no-any-return]


def generator(pair: dict[str, Path], url: str | None, **kw: Any) -> Generator:
    if url is None:
        return Generator.load(str(pair["draft"]), str(pair["target"]), device="cpu",
                              dtype="float32", **kw)
    return Generator.load(str(pair["draft"]), server=url, device="cpu", dtype="float32", **kw)


def test_padding_is_not_compared_and_its_ids_are_no_tokens(
        padded: dict[str, dict[str, Path]], tiny_models: dict[str, Path]) -> None:
    pair = padded["narrow-draft"]
    target = load_backend(str(pair["target"]), device="cpu", dtype="float32")
    draft = load_backend(str(pair["draft"]), device="cpu", dtype="float32")
    plain = load_backend(str(tiny_models["qwen2"]), device="cpu", dtype="float32")
    assert target.vocab_size == draft.vocab_size == plain.vocab_size == TOKENS
    fingerprints = {tokenizer_fingerprint(b.tokenizer, b.vocab_size)
                    for b in (target, draft, plain)}
    assert len(fingerprints) == 1  # one tokenizer, three widths (512 unpadded)
    logits = target.new_sequence().extend([5, 6, 7])
    assert logits.shape == (3, TOKENS)
    # Without the mask, transformers' own greedy output takes padded ids here: the test
    # below would fail if SpecECD let them through.
    ids = target.tokenizer.encode(PROMPTS[0])
    assert max(masked_greedy(pair["target"], ids, 30, mask=False)) >= TOKENS


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("pair_name", list(WIDTHS))
@pytest.mark.parametrize("k,proactive", [(4, "off"), ("auto", "on")])
def test_greedy_is_the_target_alone_with_padding_masked(
        pair_name: str, k: int | str, proactive: str, where: str, servers: Servers,
        padded: dict[str, dict[str, Path]]) -> None:
    pair = padded[pair_name]
    with generator(pair, servers.url_for(pair["target"], where), k=k,
                   proactive=proactive) as gen:
        for prompt in PROMPTS:
            ids = gen.prompt_ids(prompt)
            out = gen.generate(ids, max_tokens=30, temperature=0, stop_token_ids=[])
            assert out.token_ids == masked_greedy(pair["target"], ids, 30)
            assert max(out.token_ids) < TOKENS


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("pair_name", list(WORD_WIDTHS))
@pytest.mark.parametrize("mode", ["exact", "match"])
def test_sampling_keeps_the_target_distribution(
        pair_name: str, mode: str, where: str, servers: Servers,
        word_pairs: dict[str, dict[str, Path]]) -> None:
    pair = word_pairs[pair_name]
    # 10 words, and the end-of-text token transformers' Qwen2 tokenizer adds: 11 tokens.
    vocab = load_backend(str(pair["target"]), device="cpu", dtype="float32").vocab_size
    assert vocab == 11
    draws, prompt = PAIR_DRAWS, [1, 2, 3]
    with generator(pair, servers.url_for(pair["target"], where), k=3, mode=mode,
                   proactive="on") as gen:
        pairs = [c.token_ids for c in gen.generate_n(
            prompt, draws, max_tokens=2, temperature=1.0, seed=99, stop_token_ids=[])]
    assert all(len(p) == 2 and max(p) < vocab for p in pairs)
    observed = np.bincount([a * vocab + b for a, b in pairs], minlength=vocab * vocab)
    expected = exact_pair_distribution(pair["target"], prompt,
                                       SamplingParams(temperature=1.0)) * draws
    p_value = chi_square_p(observed, expected)
    print(f"padded {pair_name} {mode} over {where}: p = {p_value:.3f}")
    assert p_value > 0.001


def test_a_padded_gguf_draft_pairs_with_a_padded_transformers_target(
        padded: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    """llama.cpp's converter pads a GGUF's vocabulary with unused ``[PADn]`` tokens up to
    the embedding width; those are no tokens either."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: "
                        "pip install 'spececd[llama]' runs this test")
    from spececd.convert import convert

    pair = padded["narrow-draft"]
    gguf = convert(pair["draft"], tmp_path / "draft.f32.gguf", "f32")
    draft = load_backend(str(gguf))
    target = load_backend(str(pair["target"]), device="cpu", dtype="float32")
    assert draft.vocab_size == TOKENS and draft.new_sequence().extend([5, 6]).shape == (2, TOKENS)
    assert tokenizer_fingerprint(draft.tokenizer, draft.vocab_size) == \
        tokenizer_fingerprint(target.tokenizer, target.vocab_size)
    with Generator.load(str(gguf), str(pair["target"]), device="cpu", dtype="float32",
                        k=4) as gen:
        ids = gen.prompt_ids(PROMPTS[1])
        out = gen.generate(ids, max_tokens=30, temperature=0, stop_token_ids=[])
    assert out.token_ids == masked_greedy(pair["target"], ids, 30)

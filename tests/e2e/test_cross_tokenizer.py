"""A draft whose tokenizer is not the target's (string-level exact match): greedy output
equal to the target alone and the target's sampled distribution, in-process and over the
network; stop strings across token boundaries; and acceptance that shows the drafts get
through: a draft with the target's very predictions behind a permuted vocabulary has
every drafted token accepted under greedy decoding."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from spececd.core.params import Mode, SamplingParams  # noqa: E402
from spececd.errors import InputError  # noqa: E402
from spececd.generator import Generator  # noqa: E402
from spececd.healing import heal  # noqa: E402
from spececd.protocol.errors import IncompatibleModels  # noqa: E402
from spececd.protocol.messages import Fingerprint  # noqa: E402
from tests.builders import MODELS, requires_default_pair, word_tokenizer  # noqa: E402
from tests.chisq import PAIR_DRAWS, chi_square_p  # noqa: E402
from tests.e2e.server import ServerProcess  # noqa: E402
from tests.reference import (  # noqa: E402
    PROMPTS,
    exact_pair_distribution,
    hf_greedy,
    hf_greedy_healed,
)

WORDS = ["<unk>", "a", "b", "c", "d", "e", "f", "g", "h", "i"]


@pytest.fixture(scope="module")
def servers(tiny_models: dict[str, Path], permuted: dict[str, Path],
            shared_server: Callable[[Path], ServerProcess]
            ) -> Iterator[dict[str, ServerProcess]]:
    bpe = shared_server(tiny_models["llama"])
    words = ServerProcess(permuted["target"])
    yield {"bpe": bpe, "words": words}
    words.stop()


@pytest.fixture(scope="module")
def permuted(tiny_vocab_pair: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, Path]:
    """The 10-word target, and as the draft the same model behind a permuted vocabulary:
    another tokenizer (the same words under other ids), the same predictions in text."""
    from transformers import AutoModelForCausalLM

    order = [0, 3, 7, 1, 9, 5, 2, 8, 4, 6]  # word i gets id order[i]
    model = AutoModelForCausalLM.from_pretrained(tiny_vocab_pair["target"],
                                                 dtype=torch.float32)
    with torch.no_grad():
        for weight in (model.get_input_embeddings().weight,
                       model.get_output_embeddings().weight):
            weight[order] = weight.clone()
    root = tmp_path_factory.mktemp("permuted")
    model.save_pretrained(root / "draft")
    word_tokenizer(sorted(WORDS, key=lambda w: order[WORDS.index(w)])).save_pretrained(
        root / "draft")
    return {"target": tiny_vocab_pair["target"], "draft": root / "draft"}


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test fetches the server's tokenizer afresh, into its own cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "spececd" / "tokenizers"


def generator(draft: Path, target: Path, server: ServerProcess | None, **kw: Any
              ) -> Generator:
    """In-process, or against the server, which hands the edge its tokenizer."""
    if server is None:
        return Generator.load(str(draft), str(target), device="cpu", dtype="float32", **kw)
    return Generator.load(str(draft), server=server.url, device="cpu", dtype="float32", **kw)


@pytest.mark.parametrize("where", ["memory", "websocket"])
@pytest.mark.parametrize("k,proactive", [(4, "off"), ("auto", "on")])
def test_greedy_is_the_target_alone(where: str, k: int | str, proactive: str,
                                    tiny_models: dict[str, Path], other_tokenizer_model: Path,
                                    servers: dict[str, ServerProcess]) -> None:
    server = servers["bpe"] if where == "websocket" else None
    with generator(other_tokenizer_model, tiny_models["llama"], server, k=k,
                   proactive=proactive) as gen:
        assert gen.cross and gen.options.mode is Mode.MATCH  # exact needs one vocabulary
        drafted = 0
        for prompt in PROMPTS[:3]:
            ids = gen.prompt_ids(prompt)
            out = gen.generate(ids, max_tokens=30, temperature=0, stop_token_ids=[])
            assert out.token_ids == hf_greedy(tiny_models["llama"], ids, 30)
            drafted += out.stats.drafted
        assert drafted > 0  # the draft's text came through as target ids


@pytest.mark.parametrize("where", ["memory", pytest.param("websocket", marks=pytest.mark.slow)])
def test_healing_across_tokenizers_is_the_target_alone_on_the_healed_prompt(
        where: str, tiny_models: dict[str, Path], other_tokenizer_model: Path,
        request: pytest.FixtureRequest) -> None:
    """The mask names target ids: the edge heals with the target's tokenizer, the draft
    drafts without the mask, and the verifier keeps only what the mask allows."""
    server = request.getfixturevalue("servers")["bpe"] if where == "websocket" else None
    with generator(other_tokenizer_model, tiny_models["llama"], server, k=4) as gen:
        for prompt in ("def parse(line):\n", "class B:\n"):
            healing = heal(gen.prompt_ids(prompt), gen.tokenizer, gen.vocab_size)
            assert healing is not None
            out = gen.generate(prompt, max_tokens=20, temperature=0, stop_token_ids=[],
                               token_healing=True)
            assert out.token_ids == hf_greedy_healed(
                tiny_models["llama"], list(healing.prompt_ids), healing.allowed, 20)


def test_stop_strings_across_token_boundaries(tiny_models: dict[str, Path],
                                              other_tokenizer_model: Path) -> None:
    with generator(other_tokenizer_model, tiny_models["llama"], None, k=4) as gen:
        full = gen.generate(PROMPTS[1], max_tokens=40, temperature=0, stop_token_ids=[])
        ids = full.token_ids
        boundary = len(gen.tokenizer.decode(ids[:len(ids) // 2]))
        stop = full.text[boundary - 2:boundary + 2]
        cut = gen.generate(PROMPTS[1], max_tokens=40, temperature=0, stop_token_ids=[],
                           stop=[stop])
    assert (cut.text, cut.finish_reason) == (full.text[:full.text.find(stop)], "stop")


@pytest.mark.parametrize("where", ["memory", "websocket"])
def test_a_draft_that_predicts_like_the_target_is_accepted_throughout(
        where: str, permuted: dict[str, Path], servers: dict[str, ServerProcess]) -> None:
    server = servers["words"] if where == "websocket" else None
    with generator(permuted["draft"], permuted["target"], server, k=4, proactive="on") as gen:
        assert gen.cross
        out = gen.generate([1, 2, 3], max_tokens=40, temperature=0, stop_token_ids=[])
    assert out.stats.drafted > 20 and out.stats.accepted == out.stats.drafted
    print(f"permuted vocabulary, greedy: {out.stats.accepted}/{out.stats.drafted} accepted")


@pytest.mark.parametrize("where", ["memory", "websocket"])
def test_sampling_keeps_the_target_distribution(
        where: str, permuted: dict[str, Path], servers: dict[str, ServerProcess]) -> None:
    server = servers["words"] if where == "websocket" else None
    draws, prompt, vocab = PAIR_DRAWS, [1, 2, 3], 10
    with generator(permuted["draft"], permuted["target"], server, k=3,
                   proactive="on") as gen:
        completions = gen.generate_n(prompt, draws, max_tokens=2, temperature=1.0, seed=77,
                                     stop_token_ids=[], top_p=0.9)
    pairs = [c.token_ids for c in completions]
    assert all(len(p) == 2 for p in pairs)
    observed = np.bincount([a * vocab + b for a, b in pairs], minlength=vocab * vocab)
    expected = exact_pair_distribution(permuted["target"], prompt,
                                       SamplingParams(temperature=1.0, top_p=0.9)) * draws
    accepted = sum(c.stats.accepted for c in completions)
    drafted = sum(c.stats.drafted for c in completions)
    print(f"permuted vocabulary, sampled over {where}: acceptance "
          f"{accepted / max(drafted, 1):.3f}, p = {chi_square_p(observed, expected):.3f}")
    assert drafted > 0 and chi_square_p(observed, expected) > 0.001


def test_the_servers_tokenizer_is_fetched_checked_and_cached(
        tiny_models: dict[str, Path], other_tokenizer_model: Path,
        servers: dict[str, ServerProcess], cache: Path) -> None:
    from spececd.backends import bundle
    from spececd.backends.base import tokenizer_fingerprint
    from spececd.backends.registry import load_backend
    from spececd.transports.tokenizer import fetch

    draft = load_backend(str(other_tokenizer_model), device="cpu", dtype="float32")
    target = load_backend(str(tiny_models["llama"]), device="cpu", dtype="float32")
    own = tokenizer_fingerprint(draft.tokenizer, draft.vocab_size)
    theirs = tokenizer_fingerprint(target.tokenizer, target.vocab_size)
    assert fetch(servers["bpe"].url, theirs) is None  # the same: nothing to fetch
    fetched = fetch(servers["bpe"].url, own)
    assert fetched is not None
    tokenizer, vocab = fetched
    assert tokenizer_fingerprint(tokenizer, vocab) == theirs
    assert tokenizer.eos_token_ids == target.tokenizer.eos_token_ids
    cached = cache / f"{theirs.tokenizer_hash}.msgpack"
    assert cached.is_file()
    with pytest.raises(InputError, match="does not rebuild identically"):
        # a bundle that is not what the server said it has
        bundle.load(cached.read_bytes(), Fingerprint(theirs.vocab_size, "0" * 64))
    assert own.tokenizer_hash != theirs.tokenizer_hash
    # gRPC has no plain HTTP to fetch it over: the server refuses, and says what to pass.
    with Generator.load(str(other_tokenizer_model), server=servers["bpe"].urls["grpc"],
                        device="cpu", dtype="float32") as gen, \
            pytest.raises(IncompatibleModels, match="--target-tokenizer"):
        gen.generate("x", max_tokens=3)



def test_the_cli_drafts_across_tokenizers(tiny_models: dict[str, Path],
                                          other_tokenizer_model: Path,
                                          servers: dict[str, ServerProcess],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from spececd.cli import main

    code = main(["generate", "--draft-model", str(other_tokenizer_model), "--server",
                 servers["bpe"].url, "--target-tokenizer", str(tiny_models["llama"]),
                 "--device", "cpu", "--prompt-ids", "5,6,7", "--max-tokens", "12",
                 "--temperature", "0", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["completions"][0]["token_ids"] == hf_greedy(tiny_models["llama"], [5, 6, 7], 12)


@requires_default_pair
def test_the_default_draft_behind_a_permuted_vocabulary_keeps_its_acceptance(
        tmp_path: Path) -> None:
    """The same trained draft under other token ids: drafting across the two tokenizers
    costs no acceptance (greedy, same drafts). The cross path sends the target
    tokenizer's encoding of the drafted text, so where the draft wrote a text in more
    tokens than the tokenizer would (this pair does once on this prompt: four tokens
    re-encoded as three), it drafts fewer tokens for the same accepted ones."""
    from spececd.bench.permute import permute

    permuted = permute(MODELS / "draft", tmp_path / "draft-permuted")
    results = []
    for draft in (MODELS / "draft", permuted):
        with Generator.load(str(draft), str(MODELS / "target"), device="cpu",
                            dtype="float32", k=4) as gen:
            out = gen.generate(PROMPTS[0], max_tokens=48, temperature=0, stop_token_ids=[])
            results.append((gen.cross, out.token_ids, out.stats.accepted, out.stats.drafted))
    (same, ids, accepted, drafted), (cross, cross_ids, cross_accepted, cross_drafted) = results
    assert not same and cross and ids == cross_ids
    assert cross_accepted >= accepted > 0 and cross_drafted <= drafted

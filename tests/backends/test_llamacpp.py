"""The llama.cpp backend: GGUF conversion with llama.cpp's own converter, compatibility
with the transformers model it came from, lossless generation with a GGUF target, the
thread settings of every context, and the KV cache a token costs. The conformance suite
(extend/truncate against a fresh llama.cpp evaluation, within 1e-4) runs it in
tests/backends/test_conformance.py.

Tolerance against transformers (same weights, float32 GGUF): max |Δlogit| <= 2e-3 (llama.cpp
computes in its own kernels; ≈1e-3 was measured on these machines). Within llama.cpp: 1e-4.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: "
                                "pip install 'spececd[llama]' runs these tests")
torch = pytest.importorskip("torch")

from spececd.backends import llamacpp  # noqa: E402
from spececd.backends.base import tokenizer_fingerprint  # noqa: E402
from spececd.backends.llamacpp import kv_bytes_per_token  # noqa: E402
from spececd.backends.registry import load_backend  # noqa: E402
from spececd.convert import convert  # noqa: E402
from spececd.generator import Generator  # noqa: E402
from tests.backends.conftest import Converted  # noqa: E402
from tests.builders import MODELS, requires_default_pair  # noqa: E402
from tests.chisq import first_token_p_value  # noqa: E402
from tests.reference import PROMPTS, hf_greedy  # noqa: E402
from tests.support.conformance import transformers_fresh, worst_difference  # noqa: E402

HF_TOLERANCE = 2e-3
SELF_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def gguf(converted: Converted) -> dict[str, Path]:
    return {name: converted("gguf", name) for name in ("llama", "draft")}


def test_conversion_keeps_the_tokenizer(gguf: dict[str, Path],
                                        tiny_models: dict[str, Path]) -> None:
    ours = load_backend(str(gguf["llama"]))
    theirs = load_backend(str(tiny_models["llama"]), device="cpu", dtype="float32")
    assert tokenizer_fingerprint(ours.tokenizer, ours.vocab_size) == \
        tokenizer_fingerprint(theirs.tokenizer, theirs.vocab_size)
    for prompt in PROMPTS:
        assert ours.tokenizer.encode(prompt) == theirs.tokenizer.encode(prompt)
        assert ours.tokenizer.decode(theirs.tokenizer.encode(prompt)) == prompt


def test_extends_and_truncations_match_transformers(gguf: dict[str, Path],
                                                   tiny_models: dict[str, Path]) -> None:
    """The conformance loop against the transformers model the GGUF came from."""
    backend = load_backend(str(gguf["llama"]))
    worst = worst_difference(backend, transformers_fresh(tiny_models["llama"]), seed=3,
                             steps=20, size=100)
    print(f"llama.cpp: vs transformers {worst:.2e}")
    assert worst <= HF_TOLERANCE


def test_evaluations_longer_than_a_batch_return_the_positions_asked_for(
        gguf: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # A sequence asks llama.cpp for the logits of the positions it returns only, over
    # evaluations of at most N_BATCH tokens each (here 8): positions asked for across two
    # evaluations, within the last, and none.
    monkeypatch.setattr(llamacpp, "N_BATCH", 8)
    backend = load_backend(str(gguf["llama"]), threads=1)
    tokens = [int(t) for t in np.random.default_rng(5).integers(0, backend.vocab_size, 30)]
    stepwise = backend.new_sequence()
    expected = np.concatenate([stepwise.extend([t], keep=1) for t in tokens])
    seq = backend.new_sequence()
    for keep in (12, 5, 0):
        seq.truncate(0)
        logits = seq.extend(tokens, keep=keep)
        assert logits.shape == (keep, backend.vocab_size)
        assert np.abs(logits - expected[len(tokens) - keep:]).max(initial=0.0) <= SELF_TOLERANCE
    assert np.abs(seq.extend(tokens[:3], keep=1) - stepwise.extend(tokens[:3], keep=1)).max() \
        <= SELF_TOLERANCE  # after the last evaluation's cells, as after one's per token


def test_an_ended_sequences_context_serves_the_next_one_empty(gguf: dict[str, Path]) -> None:
    # A context costs milliseconds to make, so an ended sequence's is kept for the next
    # sequence, which must see none of its cache: the same logits as a sequence of its own.
    backend = load_backend(str(gguf["llama"]), threads=1)
    tokens = [int(t) for t in np.random.default_rng(6).integers(0, backend.vocab_size, 12)]
    alone = backend.new_sequence()  # holds the first context throughout
    expected = alone.extend(tokens, keep=3).copy()
    first = backend.new_sequence()
    first.extend(tokens[::-1])
    context = first._llm  # type: ignore[attr-defined]
    del first
    second = backend.new_sequence()
    assert second._llm is context  # type: ignore[attr-defined]
    assert second.tokens == []
    assert np.abs(second.extend(tokens, keep=3) - expected).max() <= SELF_TOLERANCE
    ended = [backend.new_sequence() for _ in range(llamacpp.IDLE_CONTEXTS + 2)]
    del ended
    assert len(backend._idle) == llamacpp.IDLE_CONTEXTS  # type: ignore[attr-defined]


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_govern_single_and_batch_evaluation(threads: int) -> None:
    # llama-cpp-python runs evaluations of several tokens (prefills, verification passes,
    # drafter catch-ups) on n_threads_batch threads, every core unless told: on a busy
    # 2-core machine a 5-token pass took 1.1-1.5 s instead of 24-29 ms. threads=1 catches
    # that on any machine with more than one core.
    backend = load_backend(str(MODELS / "draft.gguf"), threads=threads)
    first, later = backend.new_sequence(), backend.new_sequence()  # the first context, a new one
    for seq in (first, later):
        context = seq._llm._ctx.ctx  # type: ignore[attr-defined]
        assert llama_cpp.llama_n_threads(context) == threads
        assert llama_cpp.llama_n_threads_batch(context) == threads
    assert f"{threads} threads" in backend.description


@pytest.mark.parametrize(("metadata", "expected"), [
    # keys and values: layers * KV heads * (key width + value width) * 2 bytes (f16)
    ({"llama.attention.head_count_kv": "2"}, 2 * 2 * (16 + 16) * 2),  # widths 64 / 4 heads
    ({}, 2 * 4 * (16 + 16) * 2),  # no head_count_kv: every head has its own keys and values
    ({"llama.attention.head_count_kv": "2", "llama.attention.key_length": "24",
      "llama.attention.value_length": "8"}, 2 * 2 * (24 + 8) * 2),
    ({"llama.block_count": "3", "llama.attention.head_count_kv": "[2, 1, 0]"},
     (2 + 1 + 0) * (16 + 16) * 2),  # one count per layer
])
def test_kv_bytes_per_token_from_gguf_metadata(metadata: dict[str, str], expected: int) -> None:
    shape = {"general.architecture": "llama", "llama.block_count": "2",
             "llama.attention.head_count": "4", "llama.embedding_length": "64"}
    assert kv_bytes_per_token({**shape, **metadata}) == expected


def test_kv_bytes_per_token_matches_transformers_and_the_stored_state(
        gguf: dict[str, Path], tiny_models: dict[str, Path]) -> None:
    backend = load_backend(str(gguf["llama"]), threads=1)  # grouped-query attention
    reference = load_backend(str(tiny_models["llama"]), device="cpu", dtype="float32")
    assert backend.kv_bytes_per_token * 2 == reference.kv_bytes_per_token  # f16 against f32
    seq = backend.new_sequence()
    context = seq._llm._ctx.ctx  # type: ignore[attr-defined]
    seq.extend(list(range(5)), keep=0)
    before = llama_cpp.llama_state_seq_get_size(context, 0)
    seq.extend(list(range(10)), keep=0)
    per_token = (llama_cpp.llama_state_seq_get_size(context, 0) - before) / 10
    # A saved sequence also holds each cell's position and sequence ids (12 bytes in 0.3.36).
    assert backend.kv_bytes_per_token <= per_token <= backend.kv_bytes_per_token + 16


def llama_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    backend = load_backend(str(path))
    seq = backend.new_sequence()
    logits = seq.extend(ids, keep=1)
    out = []
    for _ in range(n):
        token = int(np.argmax(logits[-1]))
        out.append(token)
        logits = seq.extend([token], keep=1)
    return out


@pytest.mark.parametrize("draft_kind", ["gguf", "hf"])
def test_gguf_target_greedy_equals_the_gguf_target_alone(
        draft_kind: str, gguf: dict[str, Path], tiny_models: dict[str, Path]) -> None:
    draft = gguf["draft"] if draft_kind == "gguf" else tiny_models["draft"]
    gen = Generator.load(str(draft), str(gguf["llama"]), device="cpu", k=3)
    for prompt in PROMPTS[:3]:
        ids = gen.prompt_ids(prompt)
        out = gen.generate(ids, max_tokens=24, temperature=0, stop_token_ids=[])
        assert out.token_ids == llama_greedy(gguf["llama"], ids, 24)


def test_gguf_drafter_with_a_transformers_target(gguf: dict[str, Path],
                                                 tiny_models: dict[str, Path]) -> None:
    gen = Generator.load(str(gguf["draft"]), str(tiny_models["llama"]), device="cpu", k=4)
    ids = gen.prompt_ids(PROMPTS[0])
    out = gen.generate(ids, max_tokens=24, temperature=0, stop_token_ids=[])
    assert out.token_ids == hf_greedy(tiny_models["llama"], ids, 24)


def test_gguf_target_sampling_keeps_its_distribution(gguf: dict[str, Path]) -> None:
    gen = Generator.load(str(gguf["draft"]), str(gguf["llama"]), device="cpu", k=1)
    p_value = first_token_p_value(gen, gguf["llama"], 3000)
    print(f"GGUF target in-process: chi-square p={p_value:.4f}")
    assert p_value > 0.001


def test_gguf_target_over_the_network(gguf: dict[str, Path],
                                      tiny_models: dict[str, Path]) -> None:
    from tests.e2e.server import ServerProcess

    proc = ServerProcess(gguf["llama"])
    try:
        with Generator.load(str(tiny_models["draft"]), server=proc.url, device="cpu",
                            k=3) as gen:
            ids = gen.prompt_ids(PROMPTS[2])
            out = gen.generate(ids, max_tokens=20, temperature=0, stop_token_ids=[])
            assert out.token_ids == llama_greedy(gguf["llama"], ids, 20)
            p_value = first_token_p_value(gen, gguf["llama"], 2000)
    finally:
        proc.stop()
    print(f"GGUF target over the network: chi-square p={p_value:.4f}")
    assert p_value > 0.001


@requires_default_pair
def test_shipped_gguf_draft_pairs_with_the_default_target() -> None:
    # models/draft.gguf is `spececd convert models/draft models/draft.gguf --quant f16`:
    # the same tokenizer, and greedy output with the transformers target unchanged.
    gguf_draft = MODELS / "draft.gguf"
    target = load_backend(str(MODELS / "target"), device="cpu", dtype="float32")
    draft = load_backend(str(gguf_draft))
    assert (tokenizer_fingerprint(draft.tokenizer, draft.vocab_size)
            == tokenizer_fingerprint(target.tokenizer, target.vocab_size))
    with Generator.load(str(gguf_draft), str(MODELS / "target"), device="cpu",
                        dtype="float32", k="auto") as gen:
        ids = gen.prompt_ids(PROMPTS[0])
        out = gen.generate(ids, max_tokens=32, temperature=0, stop_token_ids=[])
        assert out.token_ids == hf_greedy(MODELS / "target", ids, 32)
        assert out.stats.accepted > 0



@requires_default_pair
def test_shipped_gguf_draft_decodes_every_token_as_transformers_does() -> None:
    # llama-cpp-python's own detokenize drops a piece longer than 32 bytes: here the tokens
    # of a newline and 35 or more spaces, which deep indentation writes.
    ours = load_backend(str(MODELS / "draft.gguf")).tokenizer
    theirs = load_backend(str(MODELS / "draft"), device="cpu", dtype="float32").tokenizer
    long_pieces = 0
    for token in range(4096):
        text = theirs.decode([token])
        assert ours.decode([token]) == text, token
        long_pieces += len(text.encode()) > 32
    assert long_pieces > 0  # the case the backend's own decoding is there for


LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}")
HEADERS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def test_a_gguf_chat_template_renders_like_transformers(tmp_path: Path) -> None:
    """A Llama-3-style template in the GGUF's metadata (written by the converter from the
    tokenizer's): system prompt and several turns give the transformers tokenizer's ids."""
    from tests.builders import build_model, train_tokenizer

    tokenizer = train_tokenizer(512)
    tokenizer.add_special_tokens({"bos_token": "<|begin_of_text|>",
                                  "additional_special_tokens": HEADERS})
    tokenizer.chat_template = LLAMA3_TEMPLATE
    folder = build_model("llama", tmp_path / "chat", tokenizer, seed=9)
    gguf = convert(folder, tmp_path / "chat.f32.gguf", "f32")
    ours = load_backend(str(gguf))
    theirs = load_backend(str(folder), device="cpu", dtype="float32")
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "def add(a, b):"},
                {"role": "assistant", "content": "return a + b"},
                {"role": "user", "content": "and subtract?"}]
    ids = ours.tokenizer.apply_chat_template(messages)
    assert ids is not None and ids == theirs.tokenizer.apply_chat_template(messages)
    specials = {tokenizer.convert_tokens_to_ids(t) for t in [*HEADERS, "<|begin_of_text|>"]}
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    assert specials <= set(ids)  # each marker one token, not spelled out
    assert ours.tokenizer.decode(ids).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    with Generator.load(str(gguf), str(folder), device="cpu", k=3) as gen:
        assert gen.chat_ids(messages) == ids
    shipped = load_backend(str(MODELS / "draft.gguf")) if (MODELS / "draft.gguf").is_file() \
        else None
    if shipped is not None:  # the default pair's template, in the GGUF as in the folder
        pair = load_backend(str(MODELS / "draft"), device="cpu")
        assert shipped.tokenizer.apply_chat_template(messages) == \
            pair.tokenizer.apply_chat_template(messages) is not None


def test_llama_cpps_own_speculation_runs_as_a_bench_peer(gguf: dict[str, Path]) -> None:
    """The bench's ``llama_speculative`` row: llama.cpp's llama-speculative-simple with the
    same GGUF pair, where scripts/build-llama-speculative.sh has built it."""
    from spececd.bench.runner import llama_speculative_binary
    from spececd.bench.worker import SpeculativeBinaryRunner

    binary = llama_speculative_binary()
    if binary is None:
        pytest.skip("llama-speculative-simple is not built here "
                    "(bash scripts/build-llama-speculative.sh builds it)")
    result = SpeculativeBinaryRunner({
        "binary": binary, "target": str(gguf["llama"]), "draft": str(gguf["draft"]),
        "max_tokens": 16, "temperature": 0, "threads": 1}).run(PROMPTS[0], 0)
    # How wall_s is read from the binary's log: tests/bench/test_speculative_binary.py.
    assert result["tokens"] >= 16
    assert result["llama_stats"]["drafted"] > 0


def test_a_tree_edge_drafts_chains_for_a_target_without_tree_attention(
        gguf: dict[str, Path]) -> None:
    """llama.cpp verifies chains: its server's welcome offers no trees, so an edge asking
    for trees drafts chains, and the output is the target's own."""
    gen = Generator.load(str(gguf["draft"]), str(gguf["llama"]), device="cpu", k=3,
                         tree_width=3, mode="greedy")
    ids = gen.prompt_ids(PROMPTS[1])
    out = gen.generate(ids, max_tokens=24, temperature=0, stop_token_ids=[])
    assert out.token_ids == llama_greedy(gguf["llama"], ids, 24)
    assert out.stats.tree_siblings == 0 and out.stats.rounds > 0


@requires_default_pair
def test_a_process_with_gguf_models_alive_exits_cleanly() -> None:
    """A mixed pair (a transformers model, then a GGUF one), alive at exit: llama.cpp's
    contexts are freed before the interpreter clears its modules (llamacpp._close_at_exit).
    Freed during that clearing, llama-cpp-python's own globals were gone: every context
    printed "Exception ignored in: Llama.__del__ ... TypeError" and was never freed."""
    script = textwrap.dedent("""
        import sys
        from spececd.backends.registry import load_backend
        target = load_backend(sys.argv[1], device="cpu", dtype="float32")
        draft = load_backend(sys.argv[2], device="cpu")
        sequences = [draft.new_sequence() for _ in range(2)]
        sequences[0].extend([1, 2, 3])
        print("exiting", flush=True)
        """)
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script,
                           str(MODELS / "draft"), str(MODELS / "draft.gguf")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and done.stdout == "exiting\n", done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr

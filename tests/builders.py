# mypy: disable-error-code="no-untyped-call"
# (transformers and tokenizers ship without complete type hints)
"""Builders of the tiny models tests use, offline: random-init models of real
architectures with a byte-level BPE tokenizer trained on a few standard-library files, and
a pair over a 10-word vocabulary; and where the default pair lives. The fixtures that build
them once per session are in ``tests/conftest.py``; torch and transformers are imported only
when a model is built.
"""

from __future__ import annotations

import os
import re
import sysconfig
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"
EOS = "<|endoftext|>"


def train_tokenizer(vocab_size: int,
                    files: tuple[str, ...] = ("textwrap.py", "shlex.py", "bisect.py")) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text() for name in files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS,
                                   pad_token=EOS)


def build_model(arch: str, path: Path, tokenizer: Any, seed: int = 0, layers: int = 2,
                hidden: int = 64, width: int = 0, context: int = 256) -> Path:
    """A random-init model of ``arch`` saved with ``tokenizer``; ``width``: its logits'
    width when it pads its output embeddings past the tokenizer (0: no padding);
    ``context``: its positions."""
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    vocab, eos = width or len(tokenizer), tokenizer.eos_token_id
    common: dict[str, Any] = dict(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos,
                                  pad_token_id=eos)
    if arch == "llama":
        model: Any = LlamaForCausalLM(LlamaConfig(
            hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
            **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(
            hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
            **common))
    elif arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=hidden, n_layer=layers, n_head=4,
                                           n_positions=context, **common))
    else:
        raise ValueError(arch)
    # Random init gives nearly uniform logits; sharpen them so that sampling tests see a
    # real distribution and greedy argmaxes are not near-ties.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"


def llama_cpp_models() -> Path:
    """The ``vendor/llama.cpp/models`` folder of llama-cpp-python's source archive: real
    vocabularies as vocab-only GGUF files (``ggml-vocab-qwen2.gguf``, ``-llama-bpe``, ...)
    and real chat templates (``templates/*.jinja``). Fetched once with pip (from the
    package index, nothing else) into ``$SPECECD_TEST_CACHE`` (default
    ``~/.cache/spececd-tests``), only those files kept; the test is skipped where pip
    cannot fetch it."""
    import subprocess
    import sys
    import tarfile
    import tempfile

    cache = Path(os.environ.get("SPECECD_TEST_CACHE") or Path.home() / ".cache" /
                 "spececd-tests") / LLAMA_CPP_SDIST.replace("==", "-")
    models = cache / "models"
    if (models / "ggml-vocab-qwen2.gguf").is_file():
        return models
    with tempfile.TemporaryDirectory() as tmp:
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "--quiet", "-d", tmp, LLAMA_CPP_SDIST], capture_output=True, text=True)
        archives = list(Path(tmp).glob("*.tar.gz"))
        if fetched.returncode or not archives:
            pytest.skip(f"pip could not fetch {LLAMA_CPP_SDIST}'s source archive: "
                        f"{fetched.stderr.strip()[-300:]}")
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cache))
        with tarfile.open(archives[0]) as archive:
            members = [m for m in archive.getmembers() if m.isfile() and re.search(
                r"/vendor/llama\.cpp/models/(ggml-vocab-[^/]*\.gguf|templates/[^/]*)$",
                m.name)]
            for member in members:
                member.name = member.name.split("/vendor/llama.cpp/models/", 1)[1]
            archive.extractall(staging, members=members, filter="data")
        try:
            staging.replace(models)  # whole or not at all, should two sessions race
        except OSError:
            if not (models / "ggml-vocab-qwen2.gguf").is_file():
                raise
    return models


def qwen25_tokenizer(models: Path) -> Any:
    """Qwen2.5's tokenizer, as far as a vocab-only GGUF gives it: Qwen2's byte-level BPE
    vocabulary (151,643 tokens and its special ones, padded to 151,936) with Qwen2.5's own
    ``<tool_call>``/``</tool_call>`` tokens added and Qwen2.5-7B-Instruct's chat template,
    which renders tools and tool calls (Hermes style); ends at ``<|im_end|>``."""
    from transformers import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer.from_pretrained(models, gguf_file="ggml-vocab-qwen2.gguf")
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = (models / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
                               ).read_text()
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


def llama31_tokenizer(models: Path) -> Any:
    """Llama 3's byte-level BPE vocabulary (``ggml-vocab-llama-bpe.gguf``) with
    Llama-3.1-8B-Instruct's chat template, which renders tools and JSON tool calls; ends at
    ``<|eot_id|>``. (Llama 3.0's vocabulary: ``<|python_tag|>`` is a reserved token.)"""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(models,
                                                        gguf_file="ggml-vocab-llama-bpe.gguf")
    tokenizer.chat_template = (models / "templates" / "meta-llama-Llama-3.1-8B-Instruct.jinja"
                               ).read_text()
    tokenizer.eos_token = "<|eot_id|>"
    return tokenizer


def default_pair_present() -> bool:
    return (MODELS / "target" / "config.json").is_file() and \
        (MODELS / "draft" / "config.json").is_file()


requires_default_pair = pytest.mark.skipif(
    not default_pair_present(), reason="the default pair under models/ is not trained yet")


def word_tokenizer(words: list[str]) -> Any:
    """A whitespace word-level tokenizer over ``words``, with no end-of-sequence token, so
    that generation always runs to max_tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0])


def vocab_pair(root: Path, arch: str = "llama", widths: tuple[int, int] = (10, 10),
               head_dim: int = 8) -> dict[str, Path]:
    """A target and a draft of ``arch`` over a 10-word vocabulary; ``widths``: the
    target's and the draft's logits widths (above 10: padded past the tokenizer);
    ``head_dim``: per attention head (vLLM's CPU attention takes 32 and more)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = word_tokenizer(["<unk>", "a", "b", "c", "d", "e", "f", "g", "h", "i"])
    kinds = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config, causal_lm = kinds[arch]
    paths = {}
    for name, seed, scale, width in (("target", 10, 4.0, widths[0]),
                                     ("draft", 11, 3.0, widths[1])):
        torch.manual_seed(seed)
        model = causal_lm(config(
            vocab_size=width, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
            max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
            pad_token_id=None))
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(scale)
        model.generation_config.eos_token_id = None
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = root / name
    return paths

"""The toy backend itself (:mod:`tests.toy`): torch-free, deterministic, and a draft that
agrees with its target as chosen. Its conformance to the backend contract is checked with
the other backends' in tests/backends/test_conformance.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from spececd.backends.base import tokenizer_fingerprint
from tests.toy import EOS, ToyBackend, ToyModel, greedy, toy_pair

REPO = Path(__file__).resolve().parents[1]


def test_the_toy_path_imports_no_torch() -> None:
    """The toy backend, the shared fixtures, the engine, the in-memory transport and the
    edge loop load without torch: a heavy import creeping into any of them fails this."""
    code = ("import sys; import tests.conftest, tests.toy, spececd.transports.memory, "
            "spececd.edge.client, spececd.transports.unary, spececd.cloud.scheduler; "
            "assert 'torch' not in sys.modules, 'torch was imported'; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_draft_agrees_with_the_target_at_the_chosen_share() -> None:
    # A draft that ignored ``agreement`` (always or never the target's row) fails this.
    rng = np.random.default_rng(0)
    for agreement in (0.0, 0.7, 1.0):
        draft, target = toy_pair(agreement)
        same = 0
        for _ in range(400):
            tokens = [int(t) for t in rng.integers(0, 256, size=3)]
            same += int(np.argmax(draft.model.forward(tokens)[-1]) ==
                        np.argmax(target.model.forward(tokens)[-1]))
        assert abs(same / 400 - agreement) < 0.08, (agreement, same)


def test_logits_depend_on_the_previous_token_and_the_position() -> None:
    """So that a cache holding a wrong token, or one at the wrong place, gives other
    logits, as in a real model."""
    model = ToyModel(3)
    base = model.forward([1, 2, 3])[-1]
    assert not np.array_equal(base, model.forward([1, 9, 3])[-1])  # previous token
    assert not np.array_equal(base, model.forward([0, 1, 2, 3])[-1])  # position


def test_the_byte_tokenizer_round_trips_and_fingerprints_its_vocabulary() -> None:
    backend = ToyBackend(ToyModel())
    text = "héllo, wörld"
    assert backend.tokenizer.decode(backend.tokenizer.encode(text)) == text
    assert backend.tokenizer.eos_token_ids == (EOS,)
    fingerprint = tokenizer_fingerprint(backend.tokenizer, backend.vocab_size)
    assert fingerprint.vocab_size == 257
    assert fingerprint != tokenizer_fingerprint(backend.tokenizer, 256)


def test_greedy_reference_is_deterministic_and_seed_dependent() -> None:
    prompt = list(b"abc")
    assert greedy(ToyBackend(ToyModel(1)), prompt, 12) == \
        greedy(ToyBackend(ToyModel(1)), prompt, 12)
    assert greedy(ToyBackend(ToyModel(1)), prompt, 12) != \
        greedy(ToyBackend(ToyModel(2)), prompt, 12)

"""Modules that moved keep their old import paths: the Python API (``spececd.api`` is now
:mod:`spececd.generator`, and warns), its text helpers (:mod:`spececd.text`) and the
strategy chooser (from :mod:`spececd.core.policy` to :mod:`spececd.core.chooser`)."""

from __future__ import annotations

import importlib
import sys

import pytest

import spececd
from spececd import generator, text
from spececd.core import chooser, policy


def test_the_python_api_keeps_its_old_path_and_warns() -> None:
    sys.modules.pop("spececd.api", None)  # imported before: import it afresh
    with pytest.warns(DeprecationWarning, match="spececd.generator"):
        api = importlib.import_module("spececd.api")
    for name in ("AsyncGenerator", "Completion", "Generator", "StreamChunk"):
        assert getattr(api, name) is getattr(generator, name) is getattr(spececd, name), name
    for name in ("IncrementalDecoder", "StopStrings"):
        assert getattr(api, name) is getattr(text, name), name
    assert "deprecated" in (api.__doc__ or "").lower()


def test_the_strategy_chooser_keeps_its_old_path() -> None:
    for name in ("Arm", "HintGate", "StrategyChooser", "STAGES", "stage", "relative_speed"):
        assert getattr(policy, name) is getattr(chooser, name), name
    assert policy.StrategyChooser.__module__ == "spececd.core.chooser"

"""The edge's options: every source parses through one place, into one typed object, and
a bad value is an InputError that names it, before any model loads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from spececd import config
from spececd.config import EdgeConfig
from spececd.core.params import Mode, SamplingParams
from spececd.edge.options import (
    FALLBACK_AFTER,
    DraftKind,
    EdgeOptions,
    Fallback,
    Proactive,
    Reconnect,
    Resolved,
    Site,
    resolve,
    sampling_params,
)
from spececd.errors import InputError
from spececd.generator import Generator


def test_text_and_python_values_give_the_same_options() -> None:
    from_text = EdgeOptions().with_settings(
        mode="match", k="3", proactive="stream", max_support="16", fallback="draft",
        reconnect_attempts="2", reconnect_delay="0.5")
    from_python = EdgeOptions().with_settings(
        mode=Mode.MATCH, k=3, proactive=Proactive.STREAM, max_support=16,
        fallback=Fallback.DRAFT, reconnect=Reconnect(attempts=2, delay=0.5))
    assert from_text == from_python == EdgeOptions(
        mode=Mode.MATCH, k=3, proactive=Proactive.STREAM, max_support=16,
        fallback=Fallback.DRAFT, reconnect=Reconnect(2, 0.5))
    assert EdgeOptions().with_settings(k=" Auto ", proactive=True).k is None
    assert EdgeOptions().with_settings(proactive=True).proactive is Proactive.ON
    assert EdgeOptions().with_settings(proactive=False).proactive is Proactive.OFF
    assert EdgeOptions(k=5).with_settings(k=None, mode=None) == EdgeOptions(k=5)  # None: kept


@pytest.mark.parametrize("setting,value,match", [
    ("k", "0", "k must be a number >= 1 or 'auto', got '0'"),
    ("k", "many", "k must be a number >= 1 or 'auto'"),
    ("k", True, "k must be a number"), ("k", 2.5, "k must be a number"),
    ("mode", "fast", "mode must be one of exact, match, greedy, threshold, got 'fast'"),
    ("mode", "threshold", "mode threshold and a threshold go together"),
    ("threshold", "0.5", "mode threshold and a threshold go together"),
    ("threshold", 1.5, "threshold must be a probability in \\(0, 1\\] \\(0: none\\), got 1.5"),
    ("threshold", -0.1, "threshold must be a number >= 0"),
    ("threshold", "none", "threshold must be a number"),
    ("proactive", "sideways", "proactive must be one of auto, off, on, stream"),
    ("fallback", "yes", "fallback must be one of none, draft"),
    ("max_support", 0, "max-support must be a number >= 1, got 0"),
    ("reconnect_attempts", "-1", "reconnect-attempts must be a number >= 0"),
    ("reconnect_delay", "soon", "reconnect-delay must be a number"),
])
def test_bad_values_are_input_errors_that_name_the_setting(setting: str, value: object,
                                                           match: str) -> None:
    with pytest.raises(InputError, match=match):
        EdgeOptions().with_settings(**{setting: value})


def test_threshold_mode_takes_its_threshold_and_no_stream_drafting() -> None:
    options = EdgeOptions().with_settings(mode="threshold", threshold="0.25")
    assert (options.mode, options.threshold) == (Mode.THRESHOLD, 0.25)
    with pytest.raises(InputError, match="stream drafting verifies by match"):
        options.with_settings(proactive="stream")


def test_an_unknown_option_is_a_programming_error() -> None:
    with pytest.raises(TypeError, match="unknown edge option 'kk'"):
        EdgeOptions().with_settings(kk=3)
    with pytest.raises(InputError, match="k must be a number >= 1"):
        EdgeOptions(k=0)  # built directly: the same checks


def test_config_sources_name_where_a_bad_option_came_from(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"^SPECECD_EDGE_K: k must be a number"):
        config.load(EdgeConfig, None, environ={"SPECECD_EDGE_K": "lots"})
    with pytest.raises(InputError, match=r"^SPECECD_EDGE_K: k must be a number >= 1"):
        config.load(EdgeConfig, None, environ={"SPECECD_EDGE_K": "0"})
    path = tmp_path / "config.toml"
    path.write_text('[edge]\nproactive = "sideways"\n')
    with pytest.raises(InputError, match=r"config.toml \[edge\] proactive: proactive must"):
        config.load(EdgeConfig, path, environ={})
    with pytest.raises(InputError, match=r"^--fallback: fallback must"):
        config.load(EdgeConfig, None, {"fallback": "maybe"}, environ={})
    loaded = config.load(EdgeConfig, None, {"proactive": "on", "reconnect_delay": 1.5},
                         environ={"SPECECD_EDGE_MODE": "greedy"})
    assert loaded.options == EdgeOptions(mode=Mode.GREEDY, proactive=Proactive.ON,
                                         reconnect=Reconnect(delay=1.5))


def test_generator_checks_options_before_loading_models(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(InputError, match="k must be a number >= 1"):
        Generator.load(missing, missing, k=0)
    with pytest.raises(InputError, match="proactive must be one of"):
        Generator.load(missing, missing, proactive="sideways")
    with pytest.raises(InputError, match="no-such-model"):  # the options were fine
        Generator.load(missing, missing, k=2, proactive="on")


def test_auto_chooses_against_a_server_and_is_off_in_process() -> None:
    remote, local = Site(in_process=False), Site(in_process=True)
    auto = EdgeOptions()
    assert auto.resolved(remote).proactive is Proactive.AUTO
    assert auto.resolved(local).proactive is Proactive.OFF
    stream = EdgeOptions(proactive=Proactive.STREAM, draft_source=DraftKind.MODEL)
    assert stream.resolved(remote) == stream
    assert stream.resolved(local) == stream  # the engine runs in-process


def test_resolving_decides_what_the_site_decides_and_only_once() -> None:
    threshold = EdgeOptions().with_settings(mode="threshold", threshold=0.3)
    assert threshold.resolved(Site(in_process=False)).proactive is Proactive.ON  # no stream
    assert threshold.resolved(Site(in_process=True)).proactive is Proactive.OFF
    cross = Site(in_process=False, cross=True)
    assert EdgeOptions().resolved(cross).mode is Mode.MATCH  # exact needs one vocabulary
    assert EdgeOptions(mode=Mode.GREEDY).resolved(cross).mode is Mode.GREEDY
    for options in (EdgeOptions(), threshold, EdgeOptions(proactive=Proactive.ON)):
        for site in (Site(False), Site(True), cross):
            once = options.resolved(site)
            assert once.resolved(site) == once


def test_what_a_session_runs_with_is_read_from_the_options() -> None:
    threshold = EdgeOptions(mode=Mode.THRESHOLD, threshold=0.3, proactive=Proactive.ON)
    assert threshold.session_mode(streams=False) == (Mode.THRESHOLD, 0.3)
    assert threshold.session_mode(streams=True) == (Mode.MATCH, 0.0)  # cloud-only
    assert EdgeOptions().session_mode(streams=True) == (Mode.MATCH, 0.0)
    assert EdgeOptions(k=3).draft_limit(max_draft=64) == 3
    assert EdgeOptions(k=12).draft_limit(max_draft=6) == 6  # the welcome's bound
    assert EdgeOptions(k_max=5).draft_limit(max_draft=64) == 5  # k auto: up to k_max
    plain = EdgeOptions(reconnect=Reconnect(attempts=3, timeout=30.0))
    assert plain.link_reconnect() == plain.reconnect
    assert plain.link_reconnect(probe=True) == Reconnect(attempts=0, timeout=30.0)
    fallback = dataclasses.replace(plain, fallback=Fallback.DRAFT)
    assert fallback.link_reconnect() == Reconnect(attempts=3, timeout=FALLBACK_AFTER)


def test_a_resolved_value_holds_what_resolving_guarantees() -> None:
    threshold = EdgeOptions(mode=Mode.THRESHOLD, threshold=0.3)
    with pytest.raises(ValueError, match="resolve the options"):
        Resolved(threshold, SamplingParams(seed=1))  # auto: rounds or stream, undecided
    with pytest.raises(ValueError, match="concrete seed"):
        Resolved(EdgeOptions(), SamplingParams())
    run = resolve(threshold, {"seed": 1}, Site(in_process=False), prompt_len=3)
    assert run == Resolved(threshold.resolved(Site(False)),
                           SamplingParams(seed=1, prompt_len=3))
    assert run.with_seed(2).params.seed == 2


def test_sampling_settings_take_sampling_params_defaults_and_the_sites_vocabulary() -> None:
    site = Site(in_process=True, vocab_size=50, eos_token_ids=(2,))
    params = sampling_params({"seed": 7, "temperature": None}, site)  # None: not given
    assert params == SamplingParams(seed=7, stop_token_ids=(2,))
    assert sampling_params({}, site).seed is not None  # drawn
    given = sampling_params({"seed": 7, "stop_token_ids": [9], "logit_bias": {4: 1, 3: -2}},
                            site)
    assert (given.stop_token_ids, given.logit_bias) == ((9,), ((3, -2.0), (4, 1.0)))
    with pytest.raises(InputError, match=r"stop_token_ids has token ids outside .*\[50\]"):
        sampling_params({"stop_token_ids": [50]}, site)
    with pytest.raises(InputError, match="logit-bias names token ids outside the vocabulary"):
        sampling_params({"logit_bias": {50: 1.0}}, site)
    with pytest.raises(InputError, match=r"biases in \[-100, 100\]"):
        sampling_params({"logit_bias": {5: 101}}, site)
    with pytest.raises(TypeError, match=r"unknown sampling setting.*tempreature"):
        sampling_params({"tempreature": 0.5}, site)

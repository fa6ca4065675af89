"""Configuration precedence: defaults < config.toml < environment < flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from spececd import config
from spececd.cloud.runner import RunnerConfig
from spececd.cloud.service import ServicePolicy
from spececd.config import EdgeConfig, ServerConfig
from spececd.core.params import SamplingParams
from spececd.errors import InputError
from spececd.protocol.cloud_session import Limits

REPO = Path(__file__).resolve().parents[1]


def test_example_file_lists_every_setting_with_its_default() -> None:
    example = REPO / "config.example.toml"
    text = example.read_text()
    for cls in (ServerConfig, EdgeConfig):
        for name in config.settings(cls):
            assert f"\n{name} = " in text, name
        assert config.load(cls, example, environ={}) == cls()


def test_precedence(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[server]\nport = 9000\nhost = "0.0.0.0"\nidle_timeout = 5\n'
                    '[edge]\nk = 6\ntemperature = 0\n')
    env = {"SPECECD_SERVER_PORT": "9100", "SPECECD_EDGE_K": "7"}
    server = config.load(ServerConfig, path, {"host": "127.0.0.2", "max_draft": None}, env)
    assert (server.port, server.host, server.idle_timeout, server.max_draft) == \
        (9100, "127.0.0.2", 5.0, 64)
    edge = config.load(EdgeConfig, path, {"k": "3"}, env)
    assert (edge.options.k, edge.temperature) == (3, 0.0)
    assert config.load(EdgeConfig, path, {}, env).options.k == 7
    assert config.load(EdgeConfig, path, {}, {}).options.k == 6
    assert config.load(EdgeConfig, path, {"k": "auto"}, env).options.k is None


@pytest.mark.parametrize("text,match", [
    ("[server]\nprot = 1\n", "unknown \\[server\\] setting"),
    ("[server]\nport = \"x\"\n", "expected int"),
    ("[server\n", "not valid TOML"),
])
def test_bad_files_are_input_errors(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(InputError, match=match):
        config.load(ServerConfig, path, environ={})


def test_bad_environment_values_are_input_errors() -> None:
    with pytest.raises(InputError, match="SPECECD_EDGE_TLS_VERIFY"):
        config.load(EdgeConfig, None, environ={"SPECECD_EDGE_TLS_VERIFY": "maybe"})
    assert not config.load(EdgeConfig, None, environ={"SPECECD_EDGE_TLS_VERIFY": "no"}).tls_verify


def test_auth_token_from_file_or_environment(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    assert config.auth_token(str(token), {}) == "s3cret"
    assert config.auth_token("", {"SPECECD_AUTH_TOKEN": "envtoken"}) == "envtoken"
    assert config.auth_token("", {}) == ""
    with pytest.raises(InputError, match="cannot read"):
        config.auth_token(str(tmp_path / "missing"), {})


def test_the_devices_table_sets_both_sides_devices(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[devices]\nedge_device = "npu"\ncloud_device = "cuda"\n'
                    '[devices.npu]\nenabled = false\n')
    edge, server = config.load(EdgeConfig, path, environ={}), config.load(ServerConfig, path,
                                                                          environ={})
    assert (edge.device, edge.npu, server.device, server.npu) == ("npu", False, "cuda", False)
    assert config.load(EdgeConfig, path, {"device": "cpu"}, {}).device == "cpu"  # flags win
    path.write_text('[edge]\ndevice = "cpu"\n[devices]\nedge_device = "npu"\n')
    with pytest.raises(InputError, match="disagree"):
        config.load(EdgeConfig, path, environ={})
    path.write_text('[edge]\nnpu = "false"\n[devices.npu]\nenabled = false\n')  # the same
    assert not config.load(EdgeConfig, path, environ={}).npu
    path.write_text('[devices]\nedge = "npu"\n')
    with pytest.raises(InputError, match=r"\[devices\] takes"):
        config.load(EdgeConfig, path, environ={})
    path.write_text('[devices.npu]\nenable = true\n')
    with pytest.raises(InputError, match="enabled = true or false"):
        config.load(ServerConfig, path, environ={})



def test_the_server_section_builds_limits_policy_and_runner_by_name() -> None:
    assert ServerConfig().limits() == Limits() and ServerConfig().policy() == ServicePolicy()
    assert ServerConfig().runner() == RunnerConfig()
    for cls, build in ((Limits, ServerConfig.limits), (ServicePolicy, ServerConfig.policy),
                       (RunnerConfig, ServerConfig.runner)):
        names = [f.name for f in dataclasses.fields(cls)]
        assert set(names) <= set(config.settings(ServerConfig)), cls  # each one configurable
        # Distinct values, so that a setting passed to another field is seen.
        changed = {name: distinct(getattr(cls(), name), i) for i, name in enumerate(names)}
        built = build(dataclasses.replace(ServerConfig(), **changed))
        assert dataclasses.asdict(built) == changed


def distinct(value: object, i: int) -> object:
    """A value of ``value``'s type that differs from it and from the other fields'."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, str):
        return f"{value}-{i}"
    assert isinstance(value, (int, float))
    return value + i + 1


def test_the_edge_sections_sampling_defaults_are_sampling_params_own() -> None:
    sampling = EdgeConfig().sampling()
    assert SamplingParams(**{**sampling, "logit_bias": ()}) == SamplingParams()
    assert set(sampling) == {f.name for f in dataclasses.fields(SamplingParams)} - {
        "seed", "stop_token_ids", "prompt_len", "heal_ids",
        "logprobs", "prompt_logprobs", "logprobs_mode"}  # asked per generation, not configured
    assert config.load(EdgeConfig, None, {"logit_bias": "5:-100, 7:2.5"}, {}).sampling()[
        "logit_bias"] == {5: -100.0, 7: 2.5}
    with pytest.raises(InputError, match="ID:BIAS pairs"):
        EdgeConfig(logit_bias="5=-100").sampling()

"""The model runners by name, as ``spececd serve --engine`` and ``[server] engine`` give it,
and the service over one.

Each runner's module is imported only when it is started, and has a ``start(model, config,
limits, metrics)`` that loads the target and returns its
:class:`~spececd.cloud.runner.ModelRunner`. This module is the one place that puts a
runner under a :class:`~spececd.cloud.service.CloudService`: the service imports no
runner, and no runner imports the service.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from spececd.backends.base import Backend
from spececd.cloud import builtin
from spececd.cloud.builtin import BuiltinRunner
from spececd.cloud.metrics import Metrics
from spececd.cloud.runner import ModelRunner, RunnerConfig
from spececd.cloud.service import CloudService, ServicePolicy
from spececd.errors import InputError
from spececd.protocol.cloud_session import Limits


@dataclass(frozen=True)
class RunnerSpec:
    """A runner by name: the module whose ``start`` loads it, and what it is."""

    name: str
    module: str
    summary: str


RUNNERS = {spec.name: spec for spec in (
    RunnerSpec("builtin", "spececd.cloud.builtin",
               "the target's backend in this process (transformers, llama.cpp, ONNX, "
               "OpenVINO), sessions batched into one forward pass"),
    RunnerSpec("vllm", "spececd.cloud.vllm",
               "vLLM's engine (paged KV, continuous batching, CUDA graphs)"),
)}


def start(name: str, model: str, config: RunnerConfig, limits: Limits,
          metrics: Metrics) -> ModelRunner:
    """Load ``model`` on the runner called ``name``."""
    spec = RUNNERS.get(name)
    if spec is None:
        raise InputError(f"engine must be one of {', '.join(RUNNERS)}, got {name!r}")
    runner: ModelRunner = importlib.import_module(spec.module).start(model, config, limits,
                                                                      metrics)
    return runner


def service(name: str, model: str, config: RunnerConfig, limits: Limits | None = None,
            policy: ServicePolicy | None = None, auth_token: str = "") -> CloudService:
    """The service over ``model`` loaded on the runner called ``name``."""
    limits, metrics = limits or Limits(), Metrics()
    return CloudService(start(name, model, config, limits, metrics), limits, policy,
                        auth_token, metrics)


def builtin_service(backend: Backend, limits: Limits | None = None,
                    policy: ServicePolicy | None = None, auth_token: str = "",
                    config: RunnerConfig | None = None) -> CloudService:
    """The service over the built-in runner serving ``backend``, loaded already (on the
    path :func:`~spececd.cloud.builtin.runner_path` gives it)."""
    config, limits, metrics = config or RunnerConfig(), limits or Limits(), Metrics()
    backend = builtin.runner_path(backend, config, limits.max_context)
    return CloudService(BuiltinRunner(backend, metrics, config), limits, policy, auth_token,
                        metrics)

"""vLLM's executors, bound to the server's life.

vLLM runs its engine in a process it spawns (``VLLM::EngineCore``), and the engine makes
its executor there, before it starts a worker or loads a weight. The subclasses here of
vLLM's two single-machine executors first call :func:`spececd.processes.end_with_parent`
in that process, so that it gets SIGKILL when the server ends, however the server ends:
vLLM 0.32's engine process watches nothing of its parent, and a SIGKILLed server left it,
its workers and their memory running. The workers (``VLLM::Worker``, children of the
engine process) are bound to it by the proposer, which vLLM makes in each of them before
the model loads (:mod:`spececd.cloud.vllm_proposer`).

vLLM sends the executor class to its engine process by name: they live in this module,
which imports vLLM and :mod:`spececd.processes` only.
"""

from __future__ import annotations

from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.executor.uniproc_executor import UniProcExecutor

from spececd.processes import end_with_parent


class BoundMultiprocExecutor(MultiprocExecutor):  # type: ignore[misc]
    """vLLM's executor over worker processes (tensor parallel, and every CPU run)."""

    def _init_executor(self) -> None:
        end_with_parent()
        super()._init_executor()


class BoundUniProcExecutor(UniProcExecutor):  # type: ignore[misc]
    """vLLM's executor that runs the model in the engine process itself (one GPU)."""

    def _init_executor(self) -> None:
        end_with_parent()
        super()._init_executor()


def bound(executor: type) -> type:
    """The executor to start where vLLM chose ``executor``: its bound subclass, or
    ``executor`` itself where there is none (Ray's, an external launcher's: processes that
    are not the server's children)."""
    return {MultiprocExecutor: BoundMultiprocExecutor,
            UniProcExecutor: BoundUniProcExecutor}.get(executor, executor)

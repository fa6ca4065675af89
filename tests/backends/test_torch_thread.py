"""Every transformers model of a process that runs on several torch threads runs on one
thread (``hf.torch_thread``): with torch's OpenMP, a second thread running models makes a
second team of workers, and more workers than cores slow every forward pass (see
``backends.base.ModelThread``). A model on one torch thread makes no team: it runs on a
thread of its own (``hf.model_thread``), so that a draft and a target of one thread each
work side by side."""

from __future__ import annotations

import os
import select
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from spececd.backends.base import Extend, ModelThread

pytest.importorskip("torch")


def test_a_model_thread_runs_calls_there_and_its_own_calls_at_once() -> None:
    thread = ModelThread("test-model")
    assert thread.call(threading.get_ident) != threading.get_ident()
    here = thread.call(threading.get_ident)
    # a call made on the thread runs inline: waiting for itself would never end
    assert thread.call(lambda: thread.call(threading.get_ident)) == here
    assert thread.call(lambda: thread.here()) and not thread.here()
    with pytest.raises(ZeroDivisionError):
        thread.call(lambda: 1 / 0)


def test_every_transformers_model_runs_on_the_torch_thread(target: Any, draft: Any) -> None:
    from spececd.backends.hf import torch_thread

    ran: list[int] = []
    hooks = [backend.model.register_forward_pre_hook(
        lambda *_: ran.append(threading.get_ident())) for backend in (target, draft)]
    try:
        ids = [3, 5, 7, 11, 13]
        alone = target.new_sequence().extend(ids)
        elsewhere = ThreadPoolExecutor(1)
        from_another = elsewhere.submit(lambda: target.new_sequence().extend(ids)).result()
        from spececd.backends.paged import PagedBackend

        packed = PagedBackend(target, 100)  # the runner's batched pass: one forward
        batched = packed.extend_batch([Extend(packed.new_sequence(), ids, 2),
                                       Extend(packed.new_sequence(), ids[:3], 1)])
        elsewhere.submit(lambda: draft.new_sequence().extend(ids, keep=1)).result()
        elsewhere.shutdown()
    finally:
        for hook in hooks:
            hook.remove()
    assert target.thread is draft.thread is torch_thread()
    assert len(ran) == 4 and set(ran) == {torch_thread().call(threading.get_ident)}
    np.testing.assert_allclose(from_another, alone, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(batched[0], alone[-2:], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX-only")
def test_a_forked_child_gets_its_own_model_thread() -> None:
    """A forked child has none of its parent's threads: the model thread starts again there
    instead of leaving its calls waiting for ever."""
    thread = ModelThread("test-fork")
    parent = thread.call(os.getpid)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, and leave without cleanup
        try:
            os.write(write, str(thread.call(os.getpid)).encode())
        finally:
            os._exit(0)
    os.close(write)
    ready, _, _ = select.select([read], [], [], 30)
    assert ready, "the child's call never ran"
    child = int(os.read(read, 64).decode())
    os.waitpid(pid, 0)
    assert child == pid != parent and thread.call(os.getpid) == parent


def test_models_on_one_torch_thread_each_run_on_threads_of_their_own(
        tiny_models: dict[str, Any]) -> None:
    """Each on a thread of its own, at one torch thread there, giving the logits the shared
    torch thread gives."""
    import torch

    from spececd.backends.hf import torch_thread
    from spececd.backends.registry import load_backend

    def load(name: str, threads: int) -> Any:
        return load_backend(str(tiny_models[name]), device="cpu", dtype="float32",
                            threads=threads)

    target, draft = load("llama", 1), load("draft", 1)
    assert len({target.thread, draft.thread, torch_thread()}) == 3
    ids = [3, 5, 7, 11, 13]
    ran: list[int] = []
    hook = target.model.register_forward_pre_hook(lambda *_: ran.append(
        threading.get_ident()))
    try:
        alone = target.new_sequence().extend(ids)
    finally:
        hook.remove()
    assert ran == [target.thread.call(threading.get_ident)]
    assert target.thread.call(torch.get_num_threads) == 1
    current = torch_thread().call(torch.get_num_threads)
    try:
        shared = load("llama", max(current, 2))
        assert shared.thread is torch_thread()
        np.testing.assert_allclose(shared.new_sequence().extend(ids), alone, rtol=1e-4,
                                   atol=1e-4)
    finally:  # as the module's other models found it
        torch_thread().call(torch.set_num_threads, current)

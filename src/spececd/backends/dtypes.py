"""What ``--dtype auto`` means: the model's own dtype where the device computes it natively,
float32 elsewhere (vLLM's convention).

Speculation pays by how little verifying k positions costs beside one decode step. In a
dtype the device computes natively that cost is nearly flat in k (a GPU; on a CPU with AMX
the default target in bfloat16 verified 17 positions for 1.1 steps, where float32 cost 2:
docs/guide/models.md#dtypes), so ``auto`` takes the model's own dtype there:

- a CPU: bfloat16 for a model stored in bfloat16, where the CPU's flags name AMX-BF16
  (``/proc/cpuinfo``; elsewhere none are read, and it is float32); float32 for every other
  model (float16 on a CPU is emulated by most kernels). AVX512-BF16 alone is not enough:
  on a Xeon with it and no AMX, the default target's step took 21.8 ms in bfloat16 against
  15.6 in float32 (one thread; 14.1 against 11.2 on two) and 17 positions cost about as
  much in either, so float32 is the faster there;
- a GPU (CUDA, Metal): the model's half dtype (bfloat16 only where the GPU computes it, not
  emulated: Ampere and later, and Metal; else float16), and bfloat16 (float16 where it lacks
  bfloat16) for a model stored in float32, as vLLM runs float32 checkpoints in half
  precision.

Greedy output is identical to the target alone *in the same dtype*: a bfloat16 target's
top two logits can be within its rounding of each other, where a pass over several
positions and a step over one round differently (tests/e2e/test_bfloat16.py).

Pure: no torch; the caller names the device and what it computes.
"""

from __future__ import annotations

from pathlib import Path

CPU_BF16_FLAGS = ("amx_bf16",)  # what computes bfloat16 faster than float32 (see above)
HALF = ("bfloat16", "float16")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s first ``flags`` line, or ``cpuinfo``'s
    text); empty where there is no such file."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_computes_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU (or one with ``flags``) computes bfloat16 natively."""
    return any(flag in (cpu_flags() if flags is None else flags) for flag in CPU_BF16_FLAGS)


def auto_dtype(stored: str | None, device: str, native_bf16: bool) -> str:
    """The dtype ``auto`` runs a model stored in ``stored`` (None: not said, read as
    float32) in on ``device`` (a torch device type: cpu, cuda, mps), where ``native_bf16``
    says whether that device computes bfloat16 natively."""
    stored = stored if stored in (*HALF, "float32") else "float32"
    if device == "cpu":
        return "bfloat16" if stored == "bfloat16" and native_bf16 else "float32"
    if stored == "float16" or not native_bf16:
        return "float16"
    return "bfloat16"


def stored_dtype(config: dict[str, object]) -> str | None:
    """The dtype a model's ``config.json`` (as a dict) says its weights are stored in
    (``dtype``, or the older ``torch_dtype``), or None."""
    value = config.get("dtype") or config.get("torch_dtype")
    return str(value).removeprefix("torch.") if value else None

"""One benchmark configuration in its own process, driven over stdin/stdout with JSON lines.

The first line is the job (what to run, on which models, with which settings); the worker
loads everything, answers ``{"ready": true}``, then answers each ``{"pass": i}`` line with
the results of one pass over all prompts. Keeping the process alive across passes lets the
runner alternate configurations without reloading models.

A job names its ``kind``, or several ``kinds`` that share what they load, each pass the
kind it runs: ``target`` and ``assisted`` (transformers' target, and each of the job's
``drafts`` as its assistant, the pass's ``draft``), ``bare`` and ``alone`` (the target on
SpecECD's backend), one copy of the target serving both.

Kinds:

- ``target``: the target alone, in-process: transformers' ``generate``;
- ``assisted``: transformers' assisted generation in-process (``assistant_model=``) with
  transformers' own defaults for the draft length schedule;
- ``llama_alone`` / ``llama_lookup``: a GGUF target alone on llama.cpp, without and with
  llama-cpp-python's own speculative decoding (prompt lookup);
- ``llama_speculative``: llama.cpp's own draft-model speculative decoding, target and
  draft GGUF in one process (``llama-speculative-simple``, built by
  ``scripts/build-llama-speculative.sh``), run once per prompt; its times are the ones it
  prints (the prompt's encoding and the decoding, not the models' loading);
- ``alone``: the target alone through SpecECD's own backend, in this process
  (:func:`~spececd.bench.alone.generate_alone`), masked by the job's JSON schema as the
  verifier masks: the constrained rows' baseline;
- ``bare``: the target's bare forward pass on the server's backend, timed over 1 to
  ``positions`` new positions after the prompt and half the generation's tokens (what a
  verify pass of that many positions costs without the server around it);
- ``spececd``: the SpecECD edge here, the verifier on the server; each pass says whether
  to draft (``spececd``) or to let the server generate and stream while the edge only
  reads (``cloud``), which server URL to use (a delay proxy per RTT) and ``k``;
- ``api``: ``spececd api`` started as a user starts it, measured by clients of its
  OpenAI API (:class:`~spececd.bench.api.ApiRunner`).

The target runs on the job's ``device`` in its ``dtype`` (transformers' ``auto``: float32
on a CPU, bfloat16 on a GPU), the edge's draft on ``draft_device``. After each prompt (or
request) the worker writes a ``{"progress": n}`` line: the runner's stall limit applies
to each of them, not to a whole pass.

Every kind generates exactly ``max_tokens`` tokens per prompt (end-of-sequence tokens do
not stop it), so tokens/s compare like with like; except under a JSON schema (a pass or a
job naming ``constraint``), whose text ends at the end-of-sequence token its grammar ends
with, at the same place in every such row (greedy: the same tokens).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

from spececd.backends.startup import skip_unused_imports
from spececd.bench.api import ApiRunner
from spececd.processes import bound, exit_now

if TYPE_CHECKING:
    from spececd.backends.base import Backend

logger = logging.getLogger(__name__)


class FirstTokenTimer:
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # the first call carries the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def job_kinds(job: dict[str, Any]) -> list[str]:
    """The kinds a job's worker runs: its ``kinds``, or its one ``kind``."""
    return list(job.get("kinds") or [job["kind"]])


class HFRunner:
    """``target`` and ``assisted``: transformers' ``generate``, with no assistant, or with
    the pass's draft (one of the job's ``drafts``, or its ``draft``)."""

    def __init__(self, job: dict[str, Any]) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from spececd.backends.hf import resolve_device, resolve_dtype

        self.torch = torch
        self.device = resolve_device(job.get("device", "cpu"))
        dtype = resolve_dtype(job.get("dtype", "auto"), self.device, job["target"])
        self.tokenizer = AutoTokenizer.from_pretrained(job["target"])
        self.model = AutoModelForCausalLM.from_pretrained(
            job["target"], dtype=dtype).to(self.device).eval()
        # each draft beside the target, as transformers has it: the model, and for another
        # tokenizer, transformers' universal assisted generation's arguments
        self.assistants: dict[str, tuple[Any, dict[str, Any]]] = {}
        drafts = ((job.get("drafts") or [job["draft"]]) if "assisted" in job_kinds(job)
                  else [])
        for draft in drafts:
            theirs = AutoTokenizer.from_pretrained(draft)
            vocab, ours = theirs.get_vocab(), self.tokenizer.get_vocab()
            if vocab.keys() == ours.keys() and vocab != ours:
                raise SystemExit(f"transformers' assisted generation takes the tokenizers of "
                                 f"{draft} and {job['target']} (the same tokens under other "
                                 "ids) for one: run this pair with --no-baselines")
            universal = (dict(tokenizer=self.tokenizer, assistant_tokenizer=theirs)
                         if vocab != ours else {})
            self.assistants[draft] = (AutoModelForCausalLM.from_pretrained(
                draft, dtype=dtype).to(self.device).eval(), universal)
        self.assistant: tuple[Any, dict[str, Any]] | None = (
            None if "target" in job_kinds(job) or not drafts else self.assistants[drafts[0]])
        self.job = job

    def configure(self, request: dict[str, Any]) -> None:
        self.assistant = (self.assistants[request.get("draft") or next(iter(self.assistants))]
                          if request.get("kind") == "assisted" else None)

    def run(self, prompt: str, seed: int) -> dict[str, Any]:
        job = self.job
        ids = self.torch.tensor([self.tokenizer(prompt)["input_ids"]], device=self.device)
        sampling: dict[str, Any] = (
            dict(do_sample=False) if job["temperature"] == 0 else
            dict(do_sample=True, temperature=job["temperature"], top_k=0, top_p=1.0))
        self.torch.manual_seed(seed)
        timer = FirstTokenTimer()
        start = time.perf_counter()
        assistant, universal = self.assistant or (None, {})
        out = self.model.generate(
            ids, max_new_tokens=job["max_tokens"], min_new_tokens=job["max_tokens"],
            assistant_model=assistant, streamer=timer, pad_token_id=0, **sampling,
            **universal)
        wall = time.perf_counter() - start
        tokens = out.shape[1] - ids.shape[1]
        ttft = (timer.first or time.perf_counter()) - start
        return {"tokens": int(tokens), "wall_s": wall, "ttft_s": ttft}


class LlamaRunner:
    """A GGUF target alone on llama.cpp, optionally with llama-cpp-python's own speculative
    decoding (``LlamaPromptLookupDecoding``: drafts by matching n-grams of the prompt and
    output; the package has no draft-model speculative decoding). Greedy."""

    def __init__(self, job: dict[str, Any]) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from spececd.backends.llamacpp import _quiet_llama_logs

        _quiet_llama_logs()
        draft = (LlamaPromptLookupDecoding(num_pred_tokens=10)
                 if job_kinds(job) == ["llama_lookup"] else None)
        threads = int(job.get("threads", 1))  # prompts too: llama-cpp-python would
        # evaluate several tokens on every core, where SpecECD's server has these threads
        self.llm = Llama(model_path=job["target"], n_ctx=0, n_threads=threads,
                         n_threads_batch=threads, draft_model=draft, verbose=False)
        self.job = job

    def run(self, prompt: str, seed: int) -> dict[str, Any]:
        if self.job["temperature"] != 0:
            raise ValueError("the llama.cpp baselines run greedy only")
        ids = self.llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
        self.llm.reset()
        start = time.perf_counter()
        first: float | None = None
        tokens = 0
        for _ in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
            first = first or time.perf_counter()
            tokens += 1
            if tokens == self.job["max_tokens"]:
                break
        wall = time.perf_counter() - start
        return {"tokens": tokens, "wall_s": wall, "ttft_s": (first or start) - start}


class SpeculativeBinaryRunner:
    """llama.cpp's ``llama-speculative-simple``: greedy, one thread for each model, the
    draft length ``k`` (4 unless the job names one)."""

    ATTEMPTS = 5

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job

    def run(self, prompt: str, seed: int) -> dict[str, Any]:
        import re
        import subprocess

        job = self.job
        if job["temperature"] != 0:
            raise ValueError("the llama.cpp baselines run greedy only")
        threads = str(job.get("threads", 1))
        command = [job["binary"], "-m", job["target"], "-md", job["draft"], "-p", prompt,
                   "-n", str(job["max_tokens"]), "--temp", "0", "--top-k", "1",
                   "--seed", str(seed), "-t", threads, "-td", threads,
                   "--spec-type", "draft-simple",
                   "--spec-draft-n-max", str(job.get("k") or 4), "--ignore-eos"]
        # llama.cpp writes its log from a worker thread and can exit before that thread has
        # written the last lines (ggml-org/llama.cpp#22142): a run that succeeded can lose
        # its timing lines, about one run in seven here. Such a run is run again.
        for attempt in range(1, self.ATTEMPTS + 1):
            done = subprocess.run(bound(command), capture_output=True, text=True,
                                  errors="replace",
                                  timeout=600)
            log = done.stdout + done.stderr  # its log lines go to either, by build
            found = {kind: re.search(rf"{kind} +(\d+) tokens in +([\d.]+) seconds", log)
                     for kind in ("encoded", "decoded")}
            if done.returncode or (found["encoded"] and found["decoded"]):
                break
            logger.info("llama-speculative-simple lost its closing log lines "
                        "(attempt %d of %d)", attempt, self.ATTEMPTS)
        if done.returncode or not found["encoded"] or not found["decoded"]:
            raise RuntimeError(f"llama-speculative-simple failed ({done.returncode}): "
                               f"{log[-500:]}")
        encoded, decoded = found["encoded"], found["decoded"]
        assert encoded is not None and decoded is not None
        tokens, decode_s = int(decoded.group(1)), float(decoded.group(2))
        encode_s = float(encoded.group(2))
        drafted = re.search(r"n_drafted += (\d+)", log)
        accepted = re.search(r"n_accept += (\d+)", log)
        stats = {"drafted": int(drafted.group(1)) if drafted else 0,
                 "accepted": int(accepted.group(1)) if accepted else 0}
        return {"tokens": tokens, "wall_s": encode_s + decode_s,
                "ttft_s": encode_s + decode_s / max(1, tokens), "llama_stats": stats}


def target_backend(job: dict[str, Any]) -> Backend:
    """The job's target on SpecECD's own backend, as the server loads it."""
    from spececd.backends.registry import load_backend

    return load_backend(job["target"], device=job.get("device", "cpu"),
                        dtype=job.get("dtype", "auto"), threads=int(job.get("threads", 1)))


class BareRunner:
    """The target's bare forward (``kind: bare``): for each prompt, a cache of the prompt's
    tokens and ``max_tokens / 2`` more, then ``extend`` of 1, 2, ... ``positions`` tokens,
    each rolled back, ``repeat`` times interleaved; the median seconds for each count."""

    def __init__(self, job: dict[str, Any], backend: Backend | None = None) -> None:
        self.backend = backend or target_backend(job)
        self.job = job

    def run(self, prompt: str, seed: int) -> dict[str, Any]:
        import statistics

        from spececd.backends.base import Extend

        ids = self.backend.tokenizer.encode(prompt)
        context = [ids[i % len(ids)] for i in range(len(ids) + self.job["max_tokens"] // 2)]
        sequence = self.backend.new_sequence()
        sequence.extend(context, keep=0)
        counts = range(1, int(self.job["positions"]) + 1)
        times: dict[int, list[float]] = {n: [] for n in counts}
        start = time.perf_counter()
        for _ in range(int(self.job["repeat"])):
            for n in counts:
                t = time.perf_counter()
                self.backend.extend_batch([Extend(sequence, context[:n], n)])
                times[n].append(time.perf_counter() - t)
                sequence.truncate(len(context))
        return {"tokens": 0, "wall_s": time.perf_counter() - start, "ttft_s": 0.0,
                "bare_s": [statistics.median(times[n]) for n in counts]}


class AloneRunner:
    """The target alone, through SpecECD's backend, under the job's JSON schema."""

    def __init__(self, job: dict[str, Any], backend: Backend | None = None) -> None:
        self.backend = backend or target_backend(job)
        self.job = job

    def run(self, prompt: str, seed: int) -> dict[str, Any]:
        from spececd.bench.alone import generate_alone
        from spececd.core.params import Constraint, SamplingParams

        job, tokenizer = self.job, self.backend.tokenizer
        ids = tokenizer.encode(prompt)
        params = SamplingParams(max_tokens=job["max_tokens"], temperature=job["temperature"],
                                seed=seed, stop_token_ids=tuple(tokenizer.eos_token_ids),
                                prompt_len=len(ids),
                                constraint=Constraint("json_schema", job["json_schema"]))
        done = generate_alone(self.backend, ids, params)
        return {"tokens": len(done.token_ids), "wall_s": done.wall_s, "ttft_s": done.first_s}


# What tells a ``cloud`` or ``spececd`` row's passes from another's at the same server.
ROW_KEYS = ("kind", "k", "proactive", "tree", "draft_source", "constrained_drafting",
            "constraint")


class SpecRunner:
    """Runs ``cloud`` and ``spececd`` passes; each pass names its server URL and ``k``."""

    def __init__(self, job: dict[str, Any]) -> None:
        from spececd.backends.registry import load_backend

        # (auto: float32 on a CPU; ``dtype`` is the target's)
        self.draft = load_backend(job["draft"], device=job.get("draft_device", "cpu"),
                                  dtype="auto", threads=int(job.get("threads", 1)))
        self.job = job
        self.generators: dict[tuple[Any, ...], Any] = {}
        self.generator: Any = None

    def configure(self, request: dict[str, Any]) -> None:
        from spececd.edge.options import EdgeOptions
        from spececd.generator import Generator
        from spececd.transports.registry import connector

        url = request["server"]
        # A client per row (its server and its settings), kept over the row's passes: what
        # a client learns of its link (auto's choices, the hint gate, what rounds would
        # bring) is then its row's alone, and the rows are measured independently.
        # One connection to a server at a time (a server holds a bounded number, and
        # evicts idle ones): the row before lets its go, and reconnects at its next pass.
        row = (url, *(request.get(key) for key in ROW_KEYS))
        if row not in self.generators:  # (a draft with another tokenizer gets the target's)
            self.generators[row] = Generator.remote(self.draft, url, connector(url))
        previous, self.generator = self.generator, self.generators[row]
        if previous is not None and previous is not self.generator:
            previous.client.close()
        # A cloud-only pass names no k, proactive setting or tree width: none applies.
        self.generator.options = EdgeOptions().with_settings(
            mode=self.job["mode"], k=request.get("k"), proactive=request.get("proactive"),
            tree_width=request.get("tree"), draft_source=request.get("draft_source"),
            constrained_drafting=request.get("constrained_drafting"))
        self.kind = request["kind"]
        self.constrained = bool(request.get("constraint"))

    def run(self, prompt: str, seed: int) -> dict[str, Any]:
        from spececd.core.params import Constraint
        from spececd.core.stats import GenerationStats

        job = self.job
        stats = GenerationStats()
        # Under the schema, the text ends where its grammar ends: at the end of sequence.
        ending: dict[str, Any] = (
            {"constraint": Constraint("json_schema", job["json_schema"])}
            if self.constrained else {"stop_token_ids": []})
        start = time.perf_counter()
        first: float | None = None
        tokens = 0
        for chunk in self.generator.stream(prompt, stats, cloud_only=self.kind == "cloud",
                                           max_tokens=job["max_tokens"],
                                           temperature=job["temperature"], seed=seed,
                                           **ending):
            if first is None:
                first = time.perf_counter()
            tokens += len(chunk.token_ids)
        wall = time.perf_counter() - start
        return {"tokens": tokens, "wall_s": wall, "ttft_s": (first or start) - start,
                "stats": stats.as_dict()}


Runner = (HFRunner | LlamaRunner | SpeculativeBinaryRunner | BareRunner | AloneRunner
          | SpecRunner | ApiRunner)


def runners(job: dict[str, Any]) -> dict[str, Runner]:
    """A runner for each of the job's kinds, those that share what they load sharing it."""
    kinds = job_kinds(job)
    made: dict[str, Runner] = {}
    if {"target", "assisted"} & set(kinds):
        made.update(dict.fromkeys({"target", "assisted"} & set(kinds), HFRunner(job)))
    if {"bare", "alone"} & set(kinds):
        backend = target_backend(job)
        made.update({kind: (BareRunner if kind == "bare" else AloneRunner)(job, backend)
                     for kind in {"bare", "alone"} & set(kinds)})
    for kind in kinds:
        if kind not in made:
            made[kind] = (ApiRunner(job) if kind == "api"
                          else LlamaRunner(job) if kind in ("llama_alone", "llama_lookup")
                          else SpeculativeBinaryRunner(job) if kind == "llama_speculative"
                          else SpecRunner(job))
    return made


def runs(kind: str) -> str:
    """The kind of the runner that runs a pass of ``kind``: the edge's runs cloud-only passes
    too, the ``api`` runner every row of the API's."""
    return "spececd" if kind == "cloud" else "api" if kind.startswith("api_") else kind


def main() -> None:
    job = json.loads(sys.stdin.readline())
    if "assisted" not in job_kinds(job):  # transformers' assisted generation may use
        skip_unused_imports()             # scikit-learn
    import torch

    torch.set_num_threads(int(job.get("threads", 1)))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    made = runners(job)
    print(json.dumps({"ready": True}), flush=True)
    done = 0

    def progress() -> None:
        nonlocal done
        done += 1
        print(json.dumps({"progress": done}), flush=True)

    try:
        for line in sys.stdin:
            request = json.loads(line)
            runner = made[runs(request["kind"])]
            if isinstance(runner, ApiRunner):
                results = runner.run_pass(request, progress)
            else:
                if isinstance(runner, SpecRunner | HFRunner):
                    runner.configure(request)
                results = []
                for i, prompt in enumerate(job["prompts"][:request.get("limit")]):
                    results.append(runner.run(prompt, job["seed"] + i))
                    progress()
            print(json.dumps({"pass": request["pass"], "results": results}), flush=True)
    finally:
        for runner in made.values():
            if isinstance(runner, ApiRunner):
                runner.close()


if __name__ == "__main__":
    main()
    exit_now(0)  # without the teardown of torch and transformers (a second)

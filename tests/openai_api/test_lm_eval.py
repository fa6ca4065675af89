"""lm-evaluation-harness against ``spececd api``: its ``local-completions`` model scores a
small multiple-choice task the test writes (a YAML task over a local JSONL file), through
``echo`` and ``logprobs`` on ``/v1/completions``, and every per-choice log-likelihood
equals the target alone's (one transformers forward pass, ``log_softmax``) within 1e-4.

Slow (a minute: lm-eval's import, the API server with the default pair): run with
``-m slow``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("torch")

from tests.builders import MODELS, requires_default_pair  # noqa: E402
from tests.e2e.server import ServerProcess  # noqa: E402
from tests.reference import hf_logprobs  # noqa: E402

pytestmark = [requires_default_pair, pytest.mark.slow]

DOCS = [
    {"question": "import os\nimport", "choices": [" sys", " re", " json"], "answer": 0},
    {"question": "def main():\n    return", "choices": [" None", " 0", " self"], "answer": 1},
    {"question": "for i in range(", "choices": ["10):", "n):", "len(x)):"], "answer": 1},
    {"question": "class Foo(", "choices": ["object):", "Exception):", "dict):"], "answer": 0},
]

TASK = """task: spececd_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def test_lm_eval_local_completions_scores_as_the_target_alone(tmp_path: Path) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tmp_path / "spececd_tiny_mc.yaml").write_text(TASK.format(data=data))
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    api = ServerProcess(MODELS / "target", "--draft-model", str(MODELS / "draft"),
                        command="api", scheme="http")
    try:
        model_args = {"model": "spececd", "base_url": f"{api.url}/v1/completions",
                      "tokenizer": str(MODELS / "target"), "tokenizer_backend": "huggingface",
                      "num_concurrent": 1, "max_retries": 1, "batch_size": 2}
        results: Any = simple_evaluate(
            model="local-completions", model_args=model_args, tasks=["spececd_tiny_mc"],
            task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
            random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    finally:
        api.stop()
    samples = results["samples"]["spececd_tiny_mc"]
    assert len(samples) == len(DOCS)
    # The same pairs of token ids lm-eval sent, scored by the target alone.
    lm = get_model("local-completions").create_from_arg_string(
        ",".join(f"{k}={v}" for k, v in model_args.items()))
    correct = 0
    for sample in samples:
        got = [float(resp[0][0]) for resp in sample["resps"]]
        want = []
        for request in sample["arguments"]:
            context, continuation = lm._encode_pair(*request)  # as lm-eval encoded it
            rows = hf_logprobs(MODELS / "target", [*context, *continuation])
            want.append(sum(rows[len(context) - 1 + i, token]
                            for i, token in enumerate(continuation)))
        assert got == pytest.approx(want, abs=1e-4), sample["doc"]
        correct += int(np.argmax(want) == sample["doc"]["answer"])
    accuracy = results["results"]["spececd_tiny_mc"]["acc,none"]
    assert accuracy == pytest.approx(correct / len(DOCS))

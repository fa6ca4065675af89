"""The OpenAI request schema decides nothing of its own: the names ``mode`` and
``proactive`` take are the enums' values, and the sampling defaults and ranges are
SamplingParams'."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from spececd.core.params import LOGIT_BIAS_LIMIT, PENALTY_LIMIT, Mode, SamplingParams
from spececd.edge.options import Proactive
from spececd.openai_api.schema import ChatRequest, CompletionRequest

REQUESTS = (CompletionRequest, ChatRequest)


def choices(schema: dict[str, Any], field: str) -> list[str]:
    (named, _none) = schema["properties"][field]["anyOf"]
    return list(named["enum"])


@pytest.mark.parametrize("request_type", REQUESTS)
def test_mode_and_proactive_take_the_enums_values(request_type: Any) -> None:
    schema = request_type.model_json_schema()
    assert choices(schema, "mode") == [m.value for m in Mode if not m.lossy]  # no lossy mode
    assert choices(schema, "proactive") == [p.value for p in Proactive]


@pytest.mark.parametrize("request_type", REQUESTS)
def test_sampling_defaults_are_sampling_params_own(request_type: Any) -> None:
    fields = request_type.model_fields
    default = SamplingParams()
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty"):
        assert fields[name].default == getattr(default, name), name


def test_the_ranges_are_sampling_params_own() -> None:
    body = {"model": "m", "prompt": "x"}
    for field, edge in (("presence_penalty", PENALTY_LIMIT),
                        ("frequency_penalty", PENALTY_LIMIT)):
        CompletionRequest(**body, **{field: edge})
        SamplingParams(**{field: edge})  # what the schema lets through, the params take
        with pytest.raises(pydantic.ValidationError, match=field):
            CompletionRequest(**body, **{field: edge + 0.5})
    CompletionRequest(**body, logit_bias={5: -LOGIT_BIAS_LIMIT})
    SamplingParams(logit_bias=((5, -LOGIT_BIAS_LIMIT),))
    with pytest.raises(pydantic.ValidationError, match="logit_bias"):
        CompletionRequest(**body, logit_bias={5: LOGIT_BIAS_LIMIT + 1})


def test_logprob_fields_are_checked_and_partial_characters_keep_their_bytes() -> None:
    """``logprobs``/``top_logprobs`` take 0 to 20 and ``logprobs_mode`` vLLM's two names
    for log-probabilities; a byte-level BPE token's own bytes come back from its string
    (transformers' table is the reference)."""
    for bad in ({"logprobs": 21}, {"logprobs": -1}, {"logprobs_mode": "raw_logits"}):
        with pytest.raises(pydantic.ValidationError):
            CompletionRequest(model="m", prompt="x", **bad)
    with pytest.raises(pydantic.ValidationError):
        ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], logprobs=True,
                    top_logprobs=21)
    assert CompletionRequest(model="m", prompt="x", max_tokens=0, echo=True).max_tokens == 0
    pytest.importorskip("transformers")
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from spececd.openai_api.server import byte_level_decoder

    assert byte_level_decoder() == {char: byte for byte, char in bytes_to_unicode().items()}


def test_a_lone_surrogate_is_found_at_any_depth_without_recursion() -> None:
    """The check walks the body with a stack of its own: a body nested past Python's
    recursion limit (json.loads takes some on 3.12 and 3.13) is a 400, not a 500."""
    from spececd.openai_api.schema import _lone_surrogate

    deep: list[Any] = []
    inner = deep
    for _ in range(5000):
        inner.append([])
        inner = inner[0]
    inner.append("x\ud800")
    found = _lone_surrogate({"user": deep, "prompt": "ok"}, "")
    assert found is not None and found.startswith(".user[0][0]") and found.endswith("[0]")
    assert _lone_surrogate({"logit_bias": {"\udfff": 1}}, "") == ".logit_bias.\\udfff"
    assert _lone_surrogate({"messages": [{"content": "fine"}]}, "") is None

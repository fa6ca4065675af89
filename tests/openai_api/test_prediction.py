"""OpenAI's Predicted Outputs through the official `openai` client, against `spececd api`
on the default pair as a newcomer starts it (in-process): ``prediction`` on chat and
completions, as a string or as text parts, drafted first where the output follows it.
Greedy output is the target alone's with any prediction, and with ``n``, logprobs and
penalties (which OpenAI refuses beside a prediction); ``usage`` counts the prediction's
tokens that appeared in the completion and the rest; a malformed prediction is a 400 that
names the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("torch")

from tests.builders import MODELS, requires_default_pair  # noqa: E402
from tests.openai_api import test_clients  # noqa: E402
from tests.openai_api.test_openai import target_text  # noqa: E402

api, client = test_clients.api, test_clients.client  # `spececd api` as a newcomer starts it

pytestmark = requires_default_pair

EDIT = json.loads((MODELS / "edit_set.json").read_text())[0] \
    if (MODELS / "edit_set.json").is_file() else {}
N = 40  # tokens a request generates


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from spececd.backends.registry import load_tokenizer

    return load_tokenizer(str(MODELS / "target"))[0]


def complete(client: Any, prediction: str | None, **fields: Any) -> Any:
    extra = {"prediction": {"type": "content", "content": prediction}} if prediction else {}
    return client.completions.create(model="spececd", prompt=EDIT["prompt"], max_tokens=N,
                                     temperature=0, extra_body=extra or None, **fields)


def test_a_prediction_is_drafted_and_the_output_stays_the_targets_own(
        client: Any, tokenizer: Any) -> None:
    """The output itself, the output with an edit, and text that is not it at all: the
    text is the target's, the prediction's tokens are drafted and kept (streamed as
    ``prediction``), and usage counts the prediction's tokens that appeared in the
    completion, and the rest."""
    expected = target_text(tokenizer, EDIT["prompt"], N)
    edited = expected.replace("(", " ( ", 1) + "\n# the end\n"
    plain = complete(client, None)
    assert plain.choices[0].text == expected
    usage: dict[str, tuple[int, int]] = {}
    for name, prediction in (("exact", expected), ("edited", edited),
                             ("unrelated", "SELECT name FROM users WHERE id = 1;\n" * 4)):
        done = complete(client, prediction)
        assert done.choices[0].text == expected, name
        details = done.usage.completion_tokens_details
        predicted = len(tokenizer.encode(prediction, bos=False))
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens \
            == predicted, name
        usage[name] = (details.accepted_prediction_tokens, details.rejected_prediction_tokens)
        spec = done.model_extra["speculative"]
        assert (spec["lookup_accepted"] > 0) == (name != "unrelated"), name
    assert usage["exact"] == (N, 0)
    assert usage["edited"][0] >= N - 6 and usage["edited"][1] >= 5  # 4 tokens more
    assert usage["unrelated"][0] <= 2
    chunks = list(client.completions.create(
        model="spececd", prompt=EDIT["prompt"], max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"prediction": {"type": "content", "content": edited}}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    sources = [c.choices[0].model_extra["spececd"]["source"] for c in chunks if c.choices]
    assert "prediction" in sources
    assert chunks[-1].usage.completion_tokens_details.rejected_prediction_tokens == \
        usage["edited"][1]


def test_chat_takes_a_prediction_in_text_parts_with_n_logprobs_and_penalties(
        client: Any) -> None:
    """Beyond OpenAI, which refuses a prediction beside ``n`` > 1, logprobs or penalties:
    here it is a draft source, so the reply is the same with or without it, log-
    probabilities included (the target's, computed by the verifier)."""
    messages = [{"role": "user", "content": EDIT["prompt"]}]
    fields: dict[str, Any] = {"model": "spececd", "messages": messages, "max_tokens": 24,
                              "temperature": 0, "n": 2, "logprobs": True, "top_logprobs": 2,
                              "presence_penalty": 0.5}
    plain = client.chat.completions.create(**fields)
    reply = plain.choices[0].message.content
    assert reply and plain.choices[1].message.content == reply
    parts = [{"type": "text", "text": reply[:len(reply) // 2]},
             {"type": "text", "text": reply[len(reply) // 2:]}]
    predicted = client.chat.completions.create(
        **fields, prediction={"type": "content", "content": parts})
    for choice, alone in zip(predicted.choices, plain.choices, strict=True):
        assert choice.message.content == reply
        got, want = choice.logprobs.content, alone.logprobs.content
        assert [e.token for e in got] == [e.token for e in want]
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-4)
        assert [[t.token for t in e.top_logprobs] for e in got] == \
            [[t.token for t in e.top_logprobs] for e in want]
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 2 * 20  # most of each choice's 24
    assert predicted.model_extra["speculative"]["lookup_accepted"] > 0


@pytest.mark.parametrize("prediction", [
    {"type": "text", "content": "x"},
    {"type": "content"},
    {"type": "content", "content": 5},
    {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
    "x = 1",
])
def test_a_malformed_prediction_is_a_400_that_names_it(client: Any, prediction: Any) -> None:
    for create, body in ((client.completions.create, {"prompt": "x", "max_tokens": 2}),
                         (client.chat.completions.create,
                          {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})):
        with pytest.raises(openai.BadRequestError) as refused:
            create(model="spececd", **body, extra_body={"prediction": prediction})
        # the field's path, as OpenAI names it (prediction, prediction.content[0].type, ...)
        assert refused.value.body["param"].startswith("prediction")
        assert "prediction" in refused.value.body["message"]


def test_a_prompt_ending_mid_word_drafts_its_prediction_from_the_first_token(
        client: Any, tokenizer: Any) -> None:
    """Token healing drops a prompt's last token, and the output's first token spells it
    again with what follows: the prediction is tokenized after that dropped text, so its
    first token is the output's (tokenized alone, the word's rest did not align and the
    first tokens were the target's own)."""
    import re

    expected = target_text(tokenizer, EDIT["prompt"], N)
    word = re.search(r"[A-Za-z_]{5,}", expected)
    assert word is not None
    cut = word.start() + 2  # within the word
    prompt = EDIT["prompt"] + expected[:cut]
    reply = client.completions.create(model="spececd", prompt=prompt, max_tokens=24,
                                      temperature=0, extra_body={"token_healing": True}
                                      ).choices[0].text  # healed, no prediction
    chunks = list(client.completions.create(
        model="spececd", prompt=prompt, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"prediction": {"type": "content", "content": reply},
                    "token_healing": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reply
    sources = [c.choices[0].model_extra["spececd"]["source"] for c in chunks if c.choices]
    assert sources[0] == "prediction", sources[:4]
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens >= 20

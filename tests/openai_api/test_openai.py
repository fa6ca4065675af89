"""`spececd api` with the official `openai` client (sync, async, streaming, chat and
completions), in front of a real `spececd serve`, both on loopback: greedy output equals
the target alone, stop strings, max_tokens and n behave as OpenAI documents, bad requests
get 400s in OpenAI's shape, and 32 concurrent streams give what they give one by one."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("torch")

from spececd.cli.options import choose_draft  # noqa: E402
from spececd.healing import heal  # noqa: E402
from tests.builders import MODELS, requires_default_pair  # noqa: E402
from tests.e2e.server import ServerProcess, free_port  # noqa: E402
from tests.reference import hf_greedy, hf_greedy_healed  # noqa: E402

pytestmark = requires_default_pair

PROMPTS = json.loads((MODELS / "heldout_prompts.json").read_text()) \
    if (MODELS / "heldout_prompts.json").is_file() else []


def api_process(*extra: str, env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess(None, "--draft-model", str(MODELS / "draft"), *extra,
                         command="api", scheme="http", env=env)


@pytest.fixture(scope="module")
def verifier(shared_server: Callable[[Path], ServerProcess]) -> ServerProcess:
    return shared_server(MODELS / "target")


@pytest.fixture(scope="module")
def api(verifier: ServerProcess) -> Iterator[ServerProcess]:
    proc = api_process("--server", verifier.url)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(api: ServerProcess) -> Any:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from spececd.backends.registry import load_backend

    return load_backend(str(MODELS / "draft"), device="cpu", dtype="float32").tokenizer


def target_text(tokenizer: Any, prompt: str | list[int], n: int, healed: bool = False
                ) -> str:
    """The target alone's greedy reply to the prompt's own tokens (the API's default), or,
    ``healed``, to a text prompt healed as the API heals it when asked (the target's own for
    the prompt without its last token, the first token one whose text starts with that
    token's; the reply's text starts after the whole prompt)."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    vocab = len(tokenizer.vocab_tokens())
    healing = heal(ids, tokenizer, vocab) if healed and isinstance(prompt, str) else None
    out = (hf_greedy_healed(MODELS / "target", list(healing.prompt_ids), healing.allowed, n)
           if healing else hf_greedy(MODELS / "target", list(ids), n))
    if set(out) & set(tokenizer.eos_token_ids):  # the end: its text is no part of the reply
        out = out[:min(out.index(t) for t in tokenizer.eos_token_ids if t in out)]
    text = str(tokenizer.decode(out))
    if healing:
        assert text.startswith(healing.dropped)
        text = text[len(healing.dropped):]
    return text


def test_models_lists_the_served_model(client: Any) -> None:
    assert [m.id for m in client.models.list()] == ["spececd"]


def test_greedy_completion_is_the_target_alone_streamed_or_not(client: Any,
                                                               tokenizer: Any) -> None:
    prompt = PROMPTS[0]
    expected = target_text(tokenizer, prompt, 40)
    whole = client.completions.create(model="spececd", prompt=prompt, max_tokens=40,
                                      temperature=0)
    assert whole.choices[0].text == expected
    usage = whole.usage
    assert usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert usage.completion_tokens == 40 and usage.total_tokens == usage.prompt_tokens + 40
    details = usage.completion_tokens_details
    spec = whole.model_extra["speculative"]
    # No prediction: its fields say none (the speculative object counts the drafts).
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)
    assert spec["num_accepted_tokens"] > 0
    assert spec["cloud_only"] is False and spec["fallback"] is False
    # In rounds: under auto, a loaded machine may have the server generate alone, and then
    # no draft is accepted (a CI run saw only the target's tokens here once).
    chunks = list(client.completions.create(model="spececd", prompt=prompt, max_tokens=40,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"proactive": "off"}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    sources = {c.choices[0].model_extra["spececd"]["source"] for c in chunks if c.choices}
    assert {"draft", "target"} <= sources  # accepted drafts and the target's own tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


# Plain rounds: under `auto` the edge may measure the server alone fastest on its link and
# let it generate without drafts, which is right but leaves no draft to see.
ROUNDS = {"proactive": "off"}


def test_a_request_chooses_where_its_drafts_come_from(client: Any, tokenizer: Any) -> None:
    """``draft_source`` per request: looked-up drafts are the target's own output too, and
    streamed with their own source; one that needs a model the edge lacks is a 400."""
    prompt = json.loads((MODELS / "copy_prompts.json").read_text())[7]  # copies itself
    expected = target_text(tokenizer, prompt, 32)
    for source in ("lookup", "suffix", "model"):
        done = client.completions.create(model="spececd", prompt=prompt, max_tokens=32,
                                         temperature=0,
                                         extra_body={"draft_source": source, **ROUNDS})
        assert done.choices[0].text == expected, source
        spec = done.model_extra["speculative"]
        assert (spec["lookup_accepted"] > 0) == (source != "model"), source
    chunks = list(client.completions.create(model="spececd", prompt=prompt, max_tokens=32,
                                            temperature=0, stream=True,
                                            extra_body={"draft_source": "lookup", **ROUNDS}))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert "lookup" in {c.choices[0].model_extra["spececd"]["source"] for c in chunks}
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="spececd", prompt=prompt, max_tokens=4,
                                  extra_body={"draft_source": "oracle"})
    assert refused.value.body["param"] == "draft_source"


def test_text_prompts_are_answered_as_given_and_healed_when_asked(client: Any,
                                                                 tokenizer: Any) -> None:
    """By default the reply continues the prompt's own tokens, as OpenAI's, vLLM's and the
    target alone's do: a prompt that ends in a newline gets the end-of-text token the
    target gives it. Asked (``token_healing: true``), the prompt is healed and gets code
    (the target's own on the prompt without its newline, the first token one that starts
    with a newline); token ids are never healed."""
    prompt = "def main():\n"

    def text(**extra: Any) -> str:
        return str(client.completions.create(model="spececd", prompt=prompt, max_tokens=16,
                                             temperature=0, extra_body=extra or None)
                   .choices[0].text)

    unhealed = text()
    assert unhealed == target_text(tokenizer, prompt, 16)
    assert text(token_healing=False) == unhealed
    healed = text(token_healing=True)
    assert healed == target_text(tokenizer, prompt, 16, healed=True) != unhealed
    assert healed.startswith("    ")
    ids = client.completions.create(model="spececd", prompt=tokenizer.encode(prompt),
                                    max_tokens=16, temperature=0).choices[0].text
    assert ids == unhealed
    with pytest.raises(openai.BadRequestError, match="token_healing"):  # completions' own
        client.chat.completions.create(model="spececd", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"token_healing": True})


def test_chat_streams_with_the_async_client(api: ServerProcess, tokenizer: Any) -> None:
    from spececd.generator import Generator

    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "def add(a, b):"}]
    with Generator.load(str(MODELS / "draft"), str(MODELS / "target"), device="cpu",
                        dtype="float32") as gen:
        expected = target_text(tokenizer, gen.chat_ids(messages), 24)

    async def run() -> tuple[str, str, list[str | None]]:
        client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
        whole = await client.chat.completions.create(model="spececd", messages=messages,
                                                     max_tokens=24, temperature=0)
        stream = await client.chat.completions.create(model="spececd", messages=messages,
                                                      max_completion_tokens=24,
                                                      temperature=0, stream=True)
        parts, roles = [], []
        async for chunk in stream:
            parts.append(chunk.choices[0].delta.content or "")
            roles.append(chunk.choices[0].delta.role)
        await client.close()
        assert whole.choices[0].message.role == "assistant"
        return whole.choices[0].message.content, "".join(parts), roles

    whole, streamed, roles = asyncio.run(run())
    assert whole == streamed == expected
    assert roles[0] == "assistant" and set(roles[1:]) <= {None}


def test_stop_strings_and_max_tokens_behave_as_openai_documents(client: Any,
                                                                tokenizer: Any) -> None:
    prompt = PROMPTS[2]
    run_on: dict[str, Any] = dict(extra_body={"ignore_eos": True})  # 48 tokens, any pair
    full = client.completions.create(model="spececd", prompt=prompt, max_tokens=48,
                                     temperature=0, **run_on).choices[0].text
    ids = tokenizer.encode(prompt + full)[len(tokenizer.encode(prompt)):]
    # A stop string across a token boundary: the end of one token and the start of the next.
    boundary = len(tokenizer.decode(ids[:len(ids) // 2]))
    stop = full[boundary - 2:boundary + 2]
    assert len(stop) == 4 and full.find(stop) > 0
    for stream in (False, True):
        out = client.completions.create(model="spececd", prompt=prompt, max_tokens=48,
                                        temperature=0, stop=[stop, "\x00never"], stream=stream,
                                        **run_on)
        if stream:
            chunks = [c for c in out if c.choices]
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert (text, finish) == (full[:full.find(stop)], "stop")
    stopped = client.completions.create(model="spececd", prompt=prompt, max_tokens=48,
                                        temperature=0, stop=[stop], **run_on)
    details = stopped.usage.completion_tokens_details
    assert stopped.usage.completion_tokens < 48  # the ids that spelled the stop, no more
    assert details.accepted_prediction_tokens <= stopped.usage.completion_tokens
    short = client.completions.create(model="spececd", prompt=prompt, max_tokens=5,
                                      temperature=0, **run_on)
    assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "length"
    assert full.startswith(short.choices[0].text)


def test_penalties_and_logit_bias_reach_both_sides(client: Any, tokenizer: Any) -> None:
    from spececd.generator import Generator

    prompt = PROMPTS[4]
    run_on: dict[str, Any] = dict(extra_body={"ignore_eos": True})  # 24 tokens, any pair
    plain = client.completions.create(model="spececd", prompt=prompt, max_tokens=24,
                                      temperature=0, **run_on).choices[0].text
    first = tokenizer.encode(prompt + plain)[len(tokenizer.encode(prompt))]
    banned = client.completions.create(model="spececd", prompt=prompt, max_tokens=24,
                                       temperature=0, logit_bias={str(first): -100},
                                       stream=True, **run_on)
    ids = [t for c in banned for t in c.choices[0].model_extra["spececd"]["token_ids"]]
    assert len(ids) == 24 and first not in ids
    sampling: dict[str, Any] = dict(presence_penalty=0.8, frequency_penalty=0.4)
    extras: dict[str, Any] = dict(repetition_penalty=1.3, min_p=0.05)
    penalized = client.completions.create(model="spececd", prompt=prompt, max_tokens=24,
                                          temperature=0, **sampling,
                                          extra_body={**extras, "ignore_eos": True})
    with Generator.load(str(MODELS / "draft"), str(MODELS / "target"), device="cpu",
                        dtype="float32") as gen:
        expected = gen.generate(prompt, max_tokens=24, temperature=0, stop_token_ids=[],
                                token_healing=False, **sampling, **extras)  # the API's default
    assert penalized.choices[0].text == expected.text != plain


def test_n_draws_independent_choices_reproducible_by_seed(client: Any) -> None:
    def draw() -> Any:
        return client.completions.create(model="spececd", prompt=PROMPTS[3], max_tokens=12,
                                         temperature=1.0, n=3, seed=11,
                                         extra_body={"k": 4, "mode": "match",
                                                     "ignore_eos": True})

    first, second = draw(), draw()
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in second.choices]  # match mode: the seed fixes the draw
    assert len(set(texts)) > 1
    assert first.usage.completion_tokens == 36
    assert first.usage.prompt_tokens == second.usage.prompt_tokens  # the prompt counts once


def test_ignore_eos_and_stop_token_ids_as_vllm_takes_them(client: Any, tokenizer: Any) -> None:
    prompt = PROMPTS[5]
    reference = hf_greedy(MODELS / "target", tokenizer.encode(prompt), 24)  # no stop at all

    def ids(**extra: Any) -> tuple[list[int], str | None]:
        # The prompt's own tokens, unhealed: a healed first position admits no
        # end-of-sequence token.
        chunks = [c for c in client.completions.create(
            model="spececd", prompt=prompt, max_tokens=24, temperature=0, stream=True,
            extra_body={"token_healing": False, **extra}) if c.choices]
        return ([t for c in chunks for t in c.choices[0].model_extra["spececd"]["token_ids"]],
                chunks[-1].choices[0].finish_reason)

    assert ids(ignore_eos=True) == (reference, "length")
    stop = reference[9]  # a token of the text: it ends the choice at its first use
    assert ids(ignore_eos=True, stop_token_ids=[stop]) == (
        reference[:reference.index(stop) + 1], "stop")
    # The end-of-sequence token made certain: it ends the choice, unless ignored.
    eos = tokenizer.eos_token_ids[0]
    assert ids(logit_bias={str(eos): 100}) == ([eos], "stop")
    assert ids(logit_bias={str(eos): 100}, ignore_eos=True) == ([eos] * 24, "length")
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        client.completions.create(model="spececd", prompt=prompt, max_tokens=2,
                                  extra_body={"stop_token_ids": [10**6]})


@pytest.mark.parametrize("fields,param,status", [
    ({"foo": 1}, "foo", 400),
    ({"k": 0}, "k", 400),
    ({"temperature": 3}, "temperature", 400),
    ({"presence_penalty": 2.5}, "presence_penalty", 400),
    ({"logit_bias": {"5": 200}}, "logit_bias.5", 400),
    ({"logit_bias": {"five": 1}}, "logit_bias.five", 400),
    ({"repetition_penalty": 0}, "repetition_penalty", 400),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", 400),
    ({"n": 0}, "n", 400),
    ({"model": "gpt-4o"}, "model", 404),
    ({"stream_options": {"include_usage": True}}, "stream_options", 400),
    ({"prompt": ""}, "prompt", 400),
])
def test_bad_requests_get_openai_errors_that_name_the_field(
        client: Any, fields: dict[str, Any], param: str | None, status: int) -> None:
    body: dict[str, Any] = {"model": "spececd", "prompt": "x", "max_tokens": 2}
    known = {k: v for k, v in fields.items() if k in ("model", "prompt", "temperature",
                                                      "presence_penalty", "logit_bias",
                                                      "stop", "n", "stream_options")}
    extra = {k: v for k, v in fields.items() if k not in known}
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(**{**body, **known}, extra_body=extra or None)
    error = caught.value
    assert error.status_code == status
    assert set(error.body) >= {"message", "type", "param", "code"}
    assert error.body["param"] == param
    if param:
        assert param in error.body["message"]


def test_unreachable_cloud_is_a_503_or_a_labelled_fallback(tokenizer: Any) -> None:
    dead = f"ws://127.0.0.1:{free_port()}"
    for extra, fallback in ((("--reconnect-attempts", "0"), False),
                            (("--reconnect-attempts", "0", "--fallback", "draft"), True)):
        proc = api_process("--server", dead, *extra)
        try:
            client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="x", max_retries=0)
            request = dict(model="spececd", prompt=PROMPTS[0], max_tokens=8, temperature=0)
            if not fallback:
                with pytest.raises(openai.APIStatusError) as caught:
                    client.completions.create(**request)
                assert caught.value.status_code == 503
                assert caught.value.body["code"] == "cloud_unreachable"
                assert "spececd serve" in caught.value.body["message"]
            else:
                out = client.completions.create(**request)
                spec = out.model_extra["speculative"]
                assert spec["fallback"] is True and spec["fallback_tokens"] == 8
        finally:
            proc.stop()


def test_the_api_key_is_required_when_set(verifier: ServerProcess) -> None:
    proc = api_process("--server", verifier.url, env={"SPECECD_API_KEY": "sk-test"})
    try:
        wrong = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        import urllib.error
        import urllib.request
        accented = urllib.request.Request(f"{proc.url}/v1/models", headers={
            "Authorization": "Bearer caf\u00e9".encode().decode("latin-1")})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(accented, timeout=10)
        assert caught.value.code == 401
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model="spececd", prompt="x", max_tokens=2)
        right = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="sk-test", max_retries=0)
        assert right.completions.create(model="spececd", prompt="x",
                                        max_tokens=2).usage.completion_tokens == 2
    finally:
        proc.stop()


def test_32_concurrent_streams_equal_their_one_by_one_outputs(client: Any,
                                                              api: ServerProcess) -> None:
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    start = time.perf_counter()
    alone = [client.completions.create(model="spececd", prompt=p, max_tokens=24,
                                       temperature=0).choices[0].text for p in prompts]
    one_by_one = 32 * 24 / (time.perf_counter() - start)

    async def one(aclient: Any, prompt: str) -> tuple[str, float]:
        start = time.perf_counter()
        first = None
        parts = []
        stream = await aclient.completions.create(model="spececd", prompt=prompt,
                                                  max_tokens=24, temperature=0, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.perf_counter() - start
            parts.extend(c.text for c in chunk.choices)
        return "".join(parts), first if first is not None else float("nan")

    async def run() -> tuple[list[tuple[str, float]], float]:
        aclient = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
        start = time.perf_counter()
        results = await asyncio.gather(*(one(aclient, p) for p in prompts))
        elapsed = time.perf_counter() - start
        await aclient.close()
        return list(results), elapsed

    results, elapsed = asyncio.run(run())
    assert [text for text, _ in results] == alone
    ttft = sorted(t for _, t in results)
    print(f"32 streams: {32 * 24 / elapsed:.1f} tokens/s in all ({one_by_one:.1f} one by "
          f"one), time to first token p50 {statistics.median(ttft):.3f} s, "
          f"p95 {ttft[int(0.95 * len(ttft)) - 1]:.3f} s")


def test_the_playground_page_is_served(api: ServerProcess) -> None:
    import urllib.request

    # `spececd api` names its draft first, and the runtime it runs in
    assert api.log[0] == f"spececd: draft {choose_draft(str(MODELS / 'draft'))}\n"
    assert api.log[0].endswith("draft (transformers)\n")

    with urllib.request.urlopen(f"{api.url}/", timeout=10) as response:
        page = response.read().decode()
    assert response.headers["content-type"].startswith("text/html")
    assert "/v1/completions" in page


def test_logprobs_and_echo_are_the_targets_own(client: Any, tokenizer: Any) -> None:
    """Completions' legacy logprobs with echo: the prompt's (the first null) and the
    completion's, equal to the target alone's forward pass; ``max_tokens: 0`` scores the
    prompt alone (lm-evaluation-harness's request)."""
    import numpy as np

    from tests.reference import hf_logprobs

    prompt = PROMPTS[2]
    ids = list(tokenizer.encode(prompt))
    generated = hf_greedy(MODELS / "target", ids, 12)
    reference = hf_logprobs(MODELS / "target", ids + generated)
    want = reference[np.arange(len(ids) + 11), (ids + generated)[1:]]
    out = client.completions.create(model="spececd", prompt=prompt, max_tokens=12,
                                    temperature=0, logprobs=3, echo=True,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text.startswith(prompt) and out.usage.completion_tokens == 12
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 12
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert np.allclose(lp.token_logprobs[1:], want, atol=1e-4)
    for top, row in zip(lp.top_logprobs[1:], reference, strict=False):
        assert 1 <= len(top) <= 4  # the 3 most likely and the chosen one (OpenAI's legacy)
        assert max(top.values()) == pytest.approx(row.max(), abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    events = list(client.completions.create(model="spececd", prompt=prompt, max_tokens=12,
                                            temperature=0, logprobs=3, echo=True, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(e.choices[0].text for e in events) == choice.text
    parts = [e.choices[0].logprobs for e in events if e.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    assert np.allclose([v for p in parts for v in p.token_logprobs][1:], want, atol=1e-4)
    scored = client.completions.create(model="spececd", prompt=prompt, max_tokens=0,
                                       temperature=0, logprobs=1, echo=True)
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert np.allclose(scored.choices[0].logprobs.token_logprobs[1:], want[:len(ids) - 1],
                       atol=1e-4)
    plain = client.completions.create(model="spececd", prompt=prompt, max_tokens=4,
                                      temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_top_logprobs_are_ordered_and_counted_streamed_or_not(client: Any) -> None:
    request: dict[str, Any] = dict(
        model="spececd", messages=[{"role": "user", "content": PROMPTS[3]}], max_tokens=10,
        temperature=0, logprobs=True, top_logprobs=4, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**request)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 10
    for entry in content:
        values = [alt.logprob for alt in entry.top_logprobs]
        assert len(values) == 4 and values == sorted(values, reverse=True)
        assert entry.logprob == values[0]  # greedy, raw: the chosen token is the likeliest
    text = whole.choices[0].message.content
    assert b"".join(bytes(e.bytes) for e in content).decode() == text  # partial characters too
    streamed = [entry for chunk in client.chat.completions.create(**request, stream=True)
                if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content],
                                                          abs=1e-4)  # passes of other shapes
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(**{**request, "logprobs": False})

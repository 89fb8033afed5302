"""State transfer edge cases found by review (openprime.core.state_transfer)."""

from __future__ import annotations

import time

import pytest
import torch

from openprime.core import digest
from openprime.core.state_transfer import StateFetch, StateOffer, send_state
from openprime.core.testing import local_group, run_threads

CHUNK, PIECE = 1000, 500


def _empty_shared() -> dict[str, torch.Tensor]:
    return {"theta": torch.zeros(0), "momentum": torch.zeros(0)}


@pytest.mark.parametrize("with_own", [False, True])
def test_an_offer_of_empty_shared_tensors_is_a_state_and_its_hash_is_checked(with_own):
    """An FSDP2 rank past a small model's rows holds empty shards of theta and momentum: its joiner was refused
    every such offer (as one "of no shared state"), so it never got the state. It is taken now, and only when the
    offer's hash is the empty state's."""
    empty_hash = digest.region_hash([], piece_bytes=PIECE)
    own = {"step": torch.tensor(3.0)} if with_own else {}
    for offered_hash, taken in ((empty_hash, True), ("not-the-empty-state", False)):
        donor_t, joiner_t = local_group(2)
        targets = _empty_shared()
        fetch = StateFetch(targets=targets)
        deadline = time.monotonic() + 30
        offer = StateOffer(step=3, origin="A", state_hash=offered_hash, shared=_empty_shared(), own=own,
                           chunk_bytes=CHUNK, piece_bytes=PIECE)
        _, complete = run_threads([lambda o=offer, d=donor_t, dl=deadline: send_state(d, 1, o, deadline=dl),
                                   lambda f=fetch, j=joiner_t, dl=deadline: f.fetch(j, 0, deadline=dl)])
        assert complete is taken, offered_hash
        if taken:
            assert fetch.tensors["theta"] is targets["theta"] and digest.combine(fetch.shared_digests()) == empty_hash
            if with_own:
                assert torch.equal(fetch.tensors["step"], torch.tensor(3.0))
        else:
            assert fetch.num_corrupt == 1

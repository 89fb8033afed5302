"""Tests of the cross-entropy and max-z-loss against hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from openprime.train.loss import IGNORE_INDEX, cross_entropy_loss, loss_with_max_z, max_z_loss

# B=1, L=2, V=3.
LOGITS_BLV = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 3.0, 1.0]]])
TARGETS_BL = torch.tensor([[0, 2]])


def _ce_by_hand(row: list[float], target: int) -> float:
    return math.log(sum(math.exp(v) for v in row)) - row[target]


def test_cross_entropy_matches_hand_computation():
    expected = (_ce_by_hand([2.0, 0.0, -1.0], 0) + _ce_by_hand([0.5, 3.0, 1.0], 2)) / 2
    assert cross_entropy_loss(LOGITS_BLV, TARGETS_BL).item() == pytest.approx(expected, rel=1e-6)


def test_max_z_loss_matches_hand_computation():
    ce = (_ce_by_hand([2.0, 0.0, -1.0], 0) + _ce_by_hand([0.5, 3.0, 1.0], 2)) / 2
    z_unweighted = (2.0**2 + 3.0**2) / 2  # max logit of each token, squared, averaged
    total, ce_part, z = loss_with_max_z(LOGITS_BLV, TARGETS_BL, z_loss_weight=2e-4)
    assert max_z_loss(LOGITS_BLV, TARGETS_BL).item() == pytest.approx(6.5)
    assert z.item() == pytest.approx(2e-4 * z_unweighted, rel=1e-6)
    assert ce_part.item() == pytest.approx(ce, rel=1e-6)
    assert total.item() == pytest.approx(ce + 2e-4 * z_unweighted, rel=1e-6)


def test_zero_weight_is_plain_cross_entropy():
    gen = torch.Generator().manual_seed(0)
    logits_BLV = torch.randn(2, 5, 11, generator=gen)
    targets_BL = torch.randint(0, 11, (2, 5), generator=gen)
    total, ce, z = loss_with_max_z(logits_BLV, targets_BL, z_loss_weight=0.0)
    expected = torch.nn.functional.cross_entropy(logits_BLV.reshape(10, 11), targets_BL.reshape(10))
    assert torch.equal(total, ce) and torch.equal(ce, expected)
    assert z.item() == 0.0


def test_ignored_targets_count_in_neither_term():
    targets_BL = torch.tensor([[0, IGNORE_INDEX]])
    total, ce, z = loss_with_max_z(LOGITS_BLV, targets_BL, z_loss_weight=1.0)
    assert ce.item() == pytest.approx(_ce_by_hand([2.0, 0.0, -1.0], 0), rel=1e-6)
    assert z.item() == pytest.approx(4.0)  # only the first token's max logit, 2.0
    assert total.item() == pytest.approx(ce.item() + 4.0, rel=1e-6)


def test_z_gradient_reaches_only_the_max_logit():
    logits_BLV = LOGITS_BLV.clone().requires_grad_(True)
    max_z_loss(logits_BLV, TARGETS_BL).backward()
    # d/dm of mean(m^2) over 2 tokens is m: 2.0 at [0,0,0] and 3.0 at [0,1,1], zero elsewhere.
    expected = torch.zeros_like(LOGITS_BLV)
    expected[0, 0, 0], expected[0, 1, 1] = 2.0, 3.0
    torch.testing.assert_close(logits_BLV.grad, expected)


def test_bf16_logits_are_reduced_in_float32():
    total, ce, z = loss_with_max_z(LOGITS_BLV.bfloat16(), TARGETS_BL, z_loss_weight=2e-4)
    assert total.dtype == ce.dtype == z.dtype == torch.float32


def test_negative_weight_is_refused():
    with pytest.raises(ValueError, match="z_loss_weight"):
        loss_with_max_z(LOGITS_BLV, TARGETS_BL, z_loss_weight=-1.0)


def test_the_validation_loss_does_not_depend_on_the_micro_batches_it_is_run_in():
    """Nodes on machines of different memory run the same held-out batches in micro-batches of their own size; the
    batches were of the micro-batch size, so such nodes scored other sequences (review of 2026-12-07)."""
    from openprime.train.loss import validation_loss

    g = torch.Generator().manual_seed(0)
    table_VV = torch.randn(16, 16, generator=g)

    def model(inputs_BL):  # a bigram model: logits of the next token from the current one
        return table_VV[inputs_BL]

    batches = [(torch.randint(0, 16, (8, 5), generator=g), torch.randint(0, 16, (8, 5), generator=g))
               for _ in range(3)]
    whole = validation_loss(model, batches, micro_batch_size=8)
    expected = sum(cross_entropy_loss(model(x), y).item() for x, y in batches) / 3
    assert whole == pytest.approx(expected, rel=1e-6)
    for micro in (1, 2, 3, 4):  # 3: a last micro-batch of 2
        assert validation_loss(model, batches, micro_batch_size=micro) == pytest.approx(whole, rel=1e-6), micro

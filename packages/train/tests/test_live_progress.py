"""What a joiner takes from its donor besides the weights: the AdamW state and the count of tokens trained."""

import torch

from openprime.train.checkpointing import InnerOptimizerState


def _node(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).square().sum().backward()
    opt.step()
    return model, opt


def test_a_joiner_continues_its_donors_token_count():
    # The donor's run was resumed with another batch size: at step 40 its nodes had trained 30,720 tokens, not
    # 40 x the joiner's 1,024 tokens per step. Before, the joiner's records counted 40,960 at step 40.
    donor_model, donor_opt = _node(0)
    donor = InnerOptimizerState(donor_model, donor_opt, progress=lambda: (40, 30_720))
    adopted = []
    joiner_model, joiner_opt = _node(1)
    joiner = InnerOptimizerState(joiner_model, joiner_opt, adopt_progress=lambda *p: adopted.append(p))
    tensors, meta = donor.own_state()
    joiner.load_own_state(tensors, meta)
    assert adopted == [(40, 30_720)]
    donor_state, joiner_state = donor_opt.state_dict()["state"], joiner_opt.state_dict()["state"]
    for key in donor_state:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(donor_state[key][name], joiner_state[key][name])


def test_a_donor_that_sends_no_token_count_leaves_the_joiners_own():
    donor_model, donor_opt = _node(0)
    tensors, meta = InnerOptimizerState(donor_model, donor_opt).own_state()
    assert "tokens" not in meta
    adopted = []
    joiner_model, joiner_opt = _node(1)
    InnerOptimizerState(joiner_model, joiner_opt, adopt_progress=lambda *p: adopted.append(p)).load_own_state(
        tensors, meta)
    assert adopted == []

"""GradientAllReduce without processes: two replicas as threads over in-memory transports (openprime.core.testing).

The end-to-end run is tests/test_data_parallel.py; this checks what each step reports and compares."""

import torch

from openprime.core.membership import StaticMembership
from openprime.core.testing import local_group, run_threads
from openprime.core.timeouts import Timeouts
from openprime.train.data_parallel import GradientAllReduce


class _Recording(StaticMembership):
    """A static group that remembers the hash each barrier was told, by the step it describes."""

    def __init__(self, transport) -> None:
        super().__init__(transport)
        self.told: dict[int, str | None] = {}

    def begin(self, step, attempt, *, state_hash, hash_step):
        self.told[hash_step] = state_hash
        return super().begin(step, attempt, state_hash=state_hash, hash_step=hash_step)


def test_each_step_reports_the_hash_of_the_weights_it_made_and_the_next_barrier_compares_it():
    torch.manual_seed(0)
    w0 = torch.randn(6)
    params = [torch.nn.Parameter(w0.clone()) for _ in range(2)]
    members = [_Recording(t) for t in local_group(2)]
    dps = [GradientAllReduce([p], membership=m, timeouts=Timeouts(op_s=10.0), joining=False)
           for p, m in zip(params, members, strict=True)]
    grads = torch.randn(3, 2, 6)  # step, replica, parameter: each replica's own gradient
    hashes = []
    for step in range(3):
        for i, p in enumerate(params):
            p.grad = grads[step, i].clone()
        run_threads([dp.sync for dp in dps])
        for p in params:  # SGD with lr 1 on the mean gradient
            with torch.no_grad():
                p.sub_(p.grad)
        results = [dp.step() for dp in dps]
        assert torch.equal(params[0], params[1])
        assert torch.allclose(params[0].detach(), w0 - grads[:step + 1].mean(dim=1).sum(dim=0), atol=1e-6)
        # Outer step s's record carries the weights after s (it carried the hash before its step).
        assert [r.state_hash for r in results] == [dp.weights_hash() for dp in dps]
        assert results[0].state_hash == results[1].state_hash
        hashes.append(results[0].state_hash)
    assert len(set(hashes)) == 3
    run_threads([lambda dp=dp: dp.sync() for dp in dps])  # the next barrier is told the last step's hash
    for m in members:
        assert [m.told[s] for s in range(3)] == hashes
        assert m.told[-1] not in hashes  # the initial weights', hashed once before the first step

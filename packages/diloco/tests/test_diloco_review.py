"""DiLoCo edge cases found by review: a replica whose FSDP2 shard is empty, and the outer update's bits on
machines whose CPUs differ."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from openprime.core.membership import Membership, Round
from openprime.core.testing import local_group, run_threads
from openprime.core.timeouts import Timeouts
from openprime.diloco import DiLoCo, DiLoCoConfig, OuterOptimizer, RecoveryMode, outer_update_
from openprime.diloco.outer import _SCRATCH_NUMEL


class AdmitsStateless(Membership):
    """One group for every try; the members that report no state are listed as new, donor rank 0. Records the
    verdicts instead of asserting in a worker thread."""

    def __init__(self, transport, barrier: threading.Barrier, shared: dict) -> None:
        self.transport, self.barrier, self.shared = transport, barrier, shared

    def begin(self, step, attempt, *, state_hash, hash_step) -> Round:
        self.barrier.wait(timeout=10)
        self.shared.setdefault("stateless", {})[self.transport.rank] = state_hash is None
        self.barrier.wait(timeout=10)
        new = tuple(r for r, s in sorted(self.shared["stateless"].items()) if s)
        self.barrier.wait(timeout=10)
        return Round(transport=self.transport, step=self.shared["step"] if state_hash is None else step,
                     attempt=attempt, new_ranks=new, donor_rank=0, skip=attempt >= 1)

    def commit(self, step, attempt, ok) -> bool:
        self.shared.setdefault("ok", {})[self.transport.rank] = ok
        self.barrier.wait(timeout=10)
        return all(self.shared["ok"].values())

    def abandon(self) -> None:
        self.transport.close()

    def close(self) -> None:
        pass


@pytest.mark.parametrize("mode", [RecoveryMode.BLOCKING, RecoveryMode.NON_BLOCKING])
def test_a_joiner_whose_shard_is_empty_receives_the_empty_state(mode):
    """Under FSDP2 a local rank may hold no element of any parameter (more local ranks than rows: rank r holds rows
    [r * ceil(n / R), ...), empty past n). Its ring's joiner was offered theta and momentum of 0 bytes and refused
    the offer as one "of no shared state": its try failed, every outer step of that ring was skipped while it lived,
    and it never got the (empty) state."""
    shared = {"step": 2}
    config = DiLoCoConfig(num_inner_steps=5, recovery=mode)
    transports, barrier = local_group(3), threading.Barrier(3)
    params = [torch.nn.Parameter(torch.zeros(0)) for _ in range(3)]
    dilocos = [DiLoCo([params[r]], config=config, timeouts=Timeouts(op_s=0.5),
                      membership=AdmitsStateless(t, barrier, shared), joining=r == 2)
               for r, t in enumerate(transports)]
    for d in dilocos[:2]:
        d.num_outer_steps_done, d.num_inner_steps_done = 2, 15
    results = run_threads([dilocos[0].sync, dilocos[1].sync, lambda: dilocos[2].sync(contribute=False)])
    dilocos[0].recovery.finish_background()
    assert shared["ok"] == {0: True, 1: True, 2: True}
    assert not any(r.skipped for r in results) and [r.num_contributors for r in results] == [2, 2, 2]
    assert dilocos[2].has_state and results[2].received_state
    assert dilocos[2].state_hash == dilocos[0].state_hash
    assert dilocos[2].num_outer_steps_done == 3 and dilocos[2].num_inner_steps_done == 15


_OUTER_STEP = """
import hashlib, sys
import numpy as np, torch
from openprime.diloco import OuterOptimizer, outer_update_
# numpy draws the values: torch.randn's own bits depend on the vector unit too
rng = np.random.default_rng(0)
theta, momentum, delta = (torch.from_numpy(rng.standard_normal(100_003, dtype=np.float32)) for _ in range(3))
delta.div_(3)  # as DiLoCo takes the mean over 3 contributors
for optimizer in OuterOptimizer:
    outer_update_(theta, momentum, delta, lr=0.7, mu=0.9, optimizer=optimizer)
state = theta.numpy().tobytes() + momentum.numpy().tobytes() + delta.numpy().tobytes()
sys.stdout.write(torch.backends.cpu.get_cpu_capability() + " " + hashlib.sha256(state).hexdigest())
"""


def test_the_outer_update_has_the_same_bits_whatever_the_cpu_s_vector_unit():
    """ATen picks its CPU kernels by the CPU (ATEN_CPU_CAPABILITY: default, avx2, avx512). With alpha,
    `theta.sub_(delta, alpha=lr)` is a fused multiply-add in the AVX2 kernels and a multiply then an add (two
    roundings) in the default ones: a node on a CPU without AVX2 (a VM whose CPU model hides it)
    computed other bits for about 0.2% of the weights than its peers, and the run stopped with ReplicaDivergence
    after its first outer step. Simulated here by forcing the default kernels in one process."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has only the default kernels: nothing to compare them with")
    outputs = []
    for capability in ("default", None):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if capability is not None:
            env["ATEN_CPU_CAPABILITY"] = capability
        run = subprocess.run([sys.executable, "-c", _OUTER_STEP], env=env, capture_output=True, text=True,
                             timeout=120, check=True)
        outputs.append(run.stdout.split())
    assert outputs[0][0] == "DEFAULT" and outputs[1][0] != "DEFAULT"  # the two really used different kernels
    assert outputs[0][1] == outputs[1][1]


@pytest.mark.parametrize("optimizer", list(OuterOptimizer))
def test_the_outer_update_over_several_scratch_pieces_matches_the_formula(optimizer):
    """The update runs piece by piece through a small scratch buffer: every piece, the last partial one included,
    gets the formula of openprime.diloco.outer (checked in float64)."""
    g = torch.Generator().manual_seed(0)
    n = 2 * _SCRATCH_NUMEL + 12_345
    theta, momentum, delta = (torch.randn(n, generator=g) for _ in range(3))
    t64, m64, d64 = theta.double(), momentum.double(), delta.double()
    outer_update_(theta, momentum, delta, lr=0.7, mu=0.9, optimizer=optimizer)
    if optimizer is not OuterOptimizer.SGD:
        m64 = 0.9 * m64 + d64
    step = {OuterOptimizer.SGD: d64, OuterOptimizer.MOMENTUM: m64, OuterOptimizer.NESTEROV: d64 + 0.9 * m64}
    torch.testing.assert_close(theta.double(), t64 - 0.7 * step[optimizer], rtol=0, atol=1e-5)
    torch.testing.assert_close(momentum.double(), m64, rtol=0, atol=1e-6)

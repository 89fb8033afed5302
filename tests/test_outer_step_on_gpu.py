"""The int8 outer step with the parameters on a GPU (needs CUDA; tools/device_check.sh runs it).

With `pseudo_gradient_device` auto and int8, DiLoCo computes the pseudo-gradient on the GPU, the ring
quantizes and accumulates there (Triton) and only the codes and codebooks pass through host memory.
Checked: the replicas end bit-identical; the result is the host path's up to quantization (the Triton
and CPU quantizers may disagree on a bucket edge, so the two paths are compared with a tolerance); the
host copy of the sum is what the outer step used.
"""

import pytest
import torch

from openprime.core.testing import local_group, run_threads
from openprime.core.timeouts import Timeouts
from openprime.diloco import Compression, DiLoCo, DiLoCoConfig, PseudoGradientDevice
from openprime.kernels import Int8Codec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")

NUMEL = (1 << 21) + 12_345  # several ring segments per chunk


def _run(where: PseudoGradientDevice, device: str) -> tuple[torch.Tensor, list[torch.Tensor], list[DiLoCo]]:
    """One outer step of 3 replicas (threads) whose parameters live on `device`; (theta0, params, dilocos)."""
    config = DiLoCoConfig(num_inner_steps=1, compression=Compression.INT8, pseudo_gradient_device=where)
    g = torch.Generator().manual_seed(0)
    theta0 = torch.randn(NUMEL, generator=g)
    local = [theta0 + 0.01 * torch.randn(NUMEL, generator=g) for _ in range(3)]
    params = [torch.nn.Parameter(theta0.clone().to(device)) for _ in range(3)]
    dilocos = [DiLoCo([p], config=config, transport=t, timeouts=Timeouts(op_s=60.0), codec=Int8Codec())
               for p, t in zip(params, local_group(3), strict=True)]
    with torch.no_grad():
        for p, w in zip(params, local, strict=True):
            p.copy_(w)
    run_threads([d.sync for d in dilocos], timeout_s=120)
    return theta0, [p.detach().cpu() for p in params], dilocos


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_int8_outer_step_with_the_pseudo_gradient_on_the_gpu():
    theta0, on_gpu, dilocos = _run(PseudoGradientDevice.AUTO, "cuda")
    assert dilocos[0]._delta_device is not None and dilocos[0]._delta_device.type == "cuda"
    for p, d in zip(on_gpu, dilocos, strict=True):
        assert torch.equal(p, on_gpu[0]) and torch.equal(d.state.theta, p)  # replicas agree; params hold theta
    assert len({d.state.state_hash() for d in dilocos}) == 1

    _, on_host, host_dilocos = _run(PseudoGradientDevice.HOST, "cuda")
    assert host_dilocos[0]._delta_device is None
    # The first Nesterov step moves theta by lr * (1 + mu) * mean(delta); the exact fp32 one, for reference.
    g = torch.Generator().manual_seed(0)
    torch.randn(NUMEL, generator=g)
    mean_delta = -torch.stack([0.01 * torch.randn(NUMEL, generator=g) for _ in range(3)]).mean(0)
    exact = theta0 - 0.7 * 1.9 * mean_delta
    update_gpu, update_host, update_exact = theta0 - on_gpu[0], theta0 - on_host[0], theta0 - exact
    # Three quantizations of a few 1.35% each (the ring's bound), and the two paths nearly the same codes.
    assert _relative(update_gpu, update_exact) < 0.05
    assert _relative(update_host, update_exact) < 0.05
    assert _relative(update_gpu, update_host) < 0.01

"""The Triton kernels against the reference, run in Triton's CPU interpreter (TRITON_INTERPRET=1).

The interpreter must be switched on before triton is first imported, and other tests in this pytest
process may import triton first, so the kernels run in a subprocess: this file, run as a script, computes
the Triton results for every case and saves them; the tests below compare them with the reference.
Sizes stay small (a few programs of a few tiles each): the interpreter runs programs one at a time.
"""

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not TRITON, reason="triton is not installed (pip install 'openprime-kernels[triton]')")

SIZES = [0, 1, 255, 256, 257, 1000, 4099]  # 4099: more tiles than programs, a ragged last tile
KINDS = ["normal", "student_t", "cauchy", "constant", "zeros"]
CASES = [(kind, n) for kind in KINDS for n in SIZES]


def make(kind: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    if kind == "normal":
        return torch.randn(n, generator=g) * 0.01 - 0.002
    if kind == "student_t":
        z, chi2 = torch.randn(n, generator=g), torch.randn(n, 2, generator=g).square().sum(1)
        return z / (chi2 / 2).sqrt()
    if kind == "cauchy":
        return torch.tan(math.pi * (torch.rand(n, generator=g) - 0.5)).clamp(-1e4, 1e4)
    if kind == "constant":
        return torch.full((n,), -0.37)
    return torch.zeros(n)


def accumulator(n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(n + 1))


def run_kernels(path: str) -> None:
    """In the subprocess: every case through the Triton kernels, saved to `path`."""
    from openprime.kernels import triton_ops

    results = {}
    for kind, n in CASES:
        codes, codebook = triton_ops.quantize_int8(make(kind, n))
        acc = triton_ops.dequantize_add_(accumulator(n), codes, codebook)
        results[f"{kind}/{n}"] = [codes, codebook, acc, triton_ops.dequantize_int8(codes, codebook)]
    errors = {}
    for bad in (math.nan, math.inf):
        x = make("normal", 300)
        x[7] = bad
        try:
            triton_ops.quantize_int8(x)
            errors[str(bad)] = ""
        except ValueError as e:
            errors[str(bad)] = str(e)
    torch.save({"results": results, "errors": errors}, path)


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory):
    path = tmp_path_factory.mktemp("triton") / "results.pt"
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, __file__, str(path)], env=env, check=True, timeout=240)
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize(("kind", "n"), CASES)
def test_triton_matches_reference(triton_results, kind, n):
    from openprime.kernels import reference

    codes, codebook, acc, decoded = triton_results["results"][f"{kind}/{n}"]
    codes_ref, codebook_ref = reference.quantize_int8(make(kind, n))
    assert codes.dtype == torch.uint8 and torch.equal(codes, codes_ref)
    # float64 sums added in another order, then rounded to fp32: equal, or one unit in the last place.
    assert (codebook.view(torch.int32).long() - codebook_ref.view(torch.int32).long()).abs().max() <= 1
    assert torch.equal(acc, reference.dequantize_add_(accumulator(n), codes, codebook))
    assert torch.equal(decoded, reference.dequantize_int8(codes, codebook))


def test_triton_rejects_nan_and_inf(triton_results):
    for message in triton_results["errors"].values():
        assert "NaN/inf" in message and "learning rate" in message


CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
LARGE = [("normal", 1 << 20), ("student_t", (1 << 22) + 17), ("cauchy", 3_000_001)]  # many programs a kernel


@pytest.mark.skipif(not CUDA, reason="no CUDA device here: the compiled kernels run in tools/device_check.sh")
@pytest.mark.parametrize(("kind", "n"), [c for c in CASES if c[1] > 0] + LARGE)  # empty: no kernel runs
def test_triton_compiled_on_cuda_matches_the_torch_path(kind, n):
    """The compiled kernels on the GPU, on the interpreter's cases and on sizes where many programs run at
    once, against the CPU torch path (which equals the reference: test_kernels_quant.py). The statistics
    are float64 partial sums added in another order, so the range may differ in its last bit: the codes
    are compared given the same range, and the range within fp32 rounding."""
    from openprime.kernels import torch_ops, triton_ops

    x = make(kind, n)
    params = torch_ops.params_of(x)
    ours = triton_ops._range(x.cuda(), 6.0)
    assert math.isclose(ours.lo, params.lo, rel_tol=1e-6, abs_tol=1e-30)
    assert math.isclose(ours.scale, params.scale, rel_tol=1e-6)
    codes, codebook = triton_ops._codes_and_codebook(x.cuda(), params)
    codes_cpu, codebook_cpu = torch_ops.bucketize_and_codebook(x, params)
    assert codes.is_cuda and torch.equal(codes.cpu(), codes_cpu.reshape(-1))
    assert (codebook.cpu().view(torch.int32).long() - codebook_cpu.view(torch.int32).long()).abs().max() <= 1
    acc = accumulator(n)
    got = triton_ops.dequantize_add_(acc.cuda(), codes, codebook).cpu()
    assert torch.equal(got, torch_ops.dequantize_add_(acc, codes.cpu(), codebook.cpu()))
    assert torch.equal(triton_ops.dequantize_int8(codes, codebook).cpu(),
                       torch_ops.dequantize_int8(codes.cpu(), codebook.cpu()))


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    run_kernels(sys.argv[1])

"""The int8 quantizer: the torch (and opt-in C++) path against the reference, the error, the codec, the ring."""

import math
import subprocess
import sys

import pytest
import torch

from openprime.core.codec import DeviceStagingCodec
from openprime.core.testing import CodecConformance
from openprime.kernels import (
    Int8Codec,
    backend_for,
    dequantize_add_,
    dequantize_int8,
    native_ops,
    quantize_int8,
    reference,
    torch_ops,
)
from openprime.kernels.params import NUM_BUCKETS

# Sizes around the edges: empty, one, a bucket's worth, and across the torch path's blocks and threads.
SIZES = [0, 1, 2, 255, 257, 1000, torch_ops.BLOCK_N + 7, 3 * torch_ops.BLOCK_N + 1001]
KINDS = ["normal", "offset", "student_t", "cauchy", "constant", "zeros", "tiny"]


def make(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    """Deterministic test chunks: pseudo-gradient-like, heavy-tailed, degenerate."""
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, generator=g) * 0.01 + 0.003
    if kind == "offset":  # |mean| >> std: the pivot keeps the variance from cancelling
        return torch.randn(n, generator=g) * 1e-3 + 7.0
    if kind == "student_t":  # df = 2: infinite variance
        z, chi2 = torch.randn(n, generator=g), torch.randn(n, 2, generator=g).square().sum(1)
        return z / (chi2 / 2).sqrt()
    if kind == "cauchy":
        return torch.tan(math.pi * (torch.rand(n, generator=g) - 0.5)).clamp(-1e4, 1e4)
    if kind == "constant":
        return torch.full((n,), 0.1)
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "tiny":
        return torch.randn(n, generator=g) * 1e-30
    raise ValueError(kind)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in units of the last place between two fp32 tensors of the same sign pattern."""
    if a.numel() == 0:
        return 0
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SIZES)
def test_torch_matches_reference(kind, n):
    x = make(kind, n)
    codes_ref, codebook_ref = reference.quantize_int8(x)
    codes, codebook = torch_ops.quantize_int8(x)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert codebook.dtype == torch.float32 and codebook.shape == (NUM_BUCKETS,)
    assert torch.equal(codes, codes_ref)
    assert ulps(codebook, codebook_ref) <= 1  # float64 sums in a different order, rounded to fp32
    acc = make("normal", n, seed=1)
    assert torch.equal(torch_ops.dequantize_add_(acc.clone(), codes, codebook),
                       reference.dequantize_add_(acc.clone(), codes, codebook))
    assert torch.equal(torch_ops.dequantize_int8(codes, codebook), reference.dequantize_int8(codes, codebook))


def test_given_the_same_range_the_codes_are_bitwise_the_reference():
    # The bucketing alone, on values placed on and next to bucket edges, where rounding decides.
    x = make("normal", 20_000)
    params = reference.params_of(x)
    edges = torch.tensor([params.lo + k / params.scale for k in range(NUM_BUCKETS + 1)], dtype=torch.float32)
    near = torch.cat([edges, edges.nextafter(torch.tensor(math.inf)), edges.nextafter(torch.tensor(-math.inf))])
    probe = torch.cat([x, near])
    codes, _ = torch_ops.bucketize_and_codebook(probe, params)
    assert torch.equal(codes, reference.bucketize(probe, params))


def test_multidimensional_and_noncontiguous():
    x = make("normal", 6 * 700).reshape(6, 700)
    for chunk in (x, x.t()):
        codes, codebook = quantize_int8(chunk)
        codes_ref, codebook_ref = reference.quantize_int8(chunk.contiguous())
        assert codes.shape == chunk.shape and torch.equal(codes.contiguous(), codes_ref)
        assert torch.equal(dequantize_int8(codes, codebook), codebook[codes.long()])


def test_codebook_holds_bucket_means_and_centres():
    x = make("normal", 50_000)
    codes, codebook = quantize_int8(x)
    params = reference.params_of(x)
    counts = torch.bincount(codes.long(), minlength=NUM_BUCKETS)
    for k in range(NUM_BUCKETS):
        if counts[k]:
            assert math.isclose(codebook[k].item(), x[codes == k].double().mean().item(), rel_tol=1e-6, abs_tol=1e-9)
        else:
            assert math.isclose(codebook[k].item(), params.lo64 + (k + 0.5) * params.step64, rel_tol=1e-6)
    # An interior bucket's mean lies inside the bucket.
    k = int(counts.argmax())
    assert params.lo + k / params.scale <= codebook[k].item() <= params.lo + (k + 1) / params.scale


@pytest.mark.parametrize("value", [0.1, -3.5e-7, 0.0, 1e30])
def test_constant_input_decodes_exactly(value):
    x = torch.full((10_001,), value)
    codes, codebook = quantize_int8(x)
    assert codes.unique().numel() == 1
    assert torch.equal(dequantize_int8(codes, codebook), x)


def test_empty_input_gives_a_codebook_of_centres():
    codes, codebook = quantize_int8(torch.empty(0))
    assert codes.shape == (0,) and codes.dtype == torch.uint8
    assert codebook.shape == (NUM_BUCKETS,) and torch.equal(codebook, torch.zeros(NUM_BUCKETS))
    assert dequantize_add_(torch.empty(0), codes, codebook).numel() == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("impl", [torch_ops, reference])
def test_nan_and_inf_are_rejected_with_a_clear_error(bad, impl):
    x = make("normal", 5000)
    x[1234] = bad
    with pytest.raises(ValueError, match=r"NaN/inf.*inner optimizer / learning rate"):
        impl.quantize_int8(x)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="float32"):
        quantize_int8(torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="range_sigmas"):
        quantize_int8(torch.zeros(10), range_sigmas=0)
    with pytest.raises(ValueError, match="same size"):
        dequantize_add_(torch.zeros(5), torch.zeros(4, dtype=torch.uint8), torch.zeros(NUM_BUCKETS))


def relative_error(x: torch.Tensor, **kwargs) -> float:
    codes, codebook = quantize_int8(x, **kwargs)
    return ((dequantize_int8(codes, codebook) - x).norm() / x.norm()).item()


def test_quantization_error_on_normal_data():
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    error = relative_error(x)
    assert 0.0130 < error < 0.0140, error  # measured 1.354% (README); bucket width 12/256 sigma
    # Bucket means beat bucket centres (what a plain uniform quantizer decodes to) ...
    params = reference.params_of(x)
    codes, _ = quantize_int8(x)
    centres = torch.tensor([params.lo64 + (k + 0.5) * params.step64 for k in range(NUM_BUCKETS)])
    assert error < ((centres.float()[codes.long()] - x).norm() / x.norm()).item()
    # ... and a narrower range trades clipping for resolution: r = 4 is finer, r = 2 clips too much.
    assert relative_error(x, range_sigmas=4.0) < error < relative_error(x, range_sigmas=2.0)


def test_deterministic_whatever_the_number_of_threads():
    x = make("student_t", 5 * torch_ops.BLOCK_N + 3)
    threads = torch.get_num_threads()
    try:
        payloads = []
        for num_threads in (1, 2, 1, 2):
            torch.set_num_threads(num_threads)
            payloads.append(quantize_int8(x))
    finally:
        torch.set_num_threads(threads)
    for codes, codebook in payloads[1:]:
        assert torch.equal(codes, payloads[0][0]) and torch.equal(codebook.view(torch.int32),
                                                                   payloads[0][1].view(torch.int32))


def test_codec_round_trip_and_accumulation():
    codec = Int8Codec()
    assert codec.name == "int8"
    chunk = make("normal", 10_000)
    payload = codec.encode(chunk)
    like = codec.payload_like(chunk.numel())
    assert [(p.dtype, p.shape) for p in payload] == [(p.dtype, p.shape) for p in like]
    assert all(p.data_ptr() != chunk.data_ptr() for p in payload)
    before = [p.clone() for p in payload]
    chunk.add_(1.0)  # the caller may reuse the chunk at once: the payload does not alias it
    assert all(torch.equal(a, b) for a, b in zip(before, payload, strict=True))
    chunk.sub_(1.0)

    out = torch.full_like(chunk, 123.0)
    codec.decode_(out, payload)
    assert (out - chunk).norm() / chunk.norm() < 0.02
    acc = make("normal", 10_000, seed=5)
    expected = acc + out
    codec.decode_add_(acc, payload)
    assert torch.equal(acc, expected)
    for received, sent in zip(like, payload, strict=True):  # what a transport does with payload_like
        received.copy_(sent)
    codec.decode_add_(acc, like)
    assert torch.equal(acc, expected + out)


def test_codec_payload_bytes_are_deterministic():
    codec, chunk = Int8Codec(), make("cauchy", 40_000)
    first = b"".join(p.numpy().tobytes() for p in codec.encode(chunk))
    for _ in range(3):
        assert b"".join(p.numpy().tobytes() for p in codec.encode(chunk.clone())) == first
    assert len(first) == chunk.numel() + 4 * NUM_BUCKETS


class TestInt8Codec(CodecConformance):
    # The suite's ring test is the int8 ring of the issue: replicas bit-identical, error a few round trips.
    make_codec = staticmethod(Int8Codec)
    max_relative_error = 0.015  # 1.35% on normal data (test_quantization_error_on_normal_data)


class TestInt8CodecStaged(CodecConformance):
    make_codec = staticmethod(lambda: DeviceStagingCodec(Int8Codec()))
    max_relative_error = 0.015


class TestInt8CodecStagedCuda(TestInt8CodecStaged):
    # What ring_all_reduce runs for a pseudo-gradient on the GPU: Triton there, codes through the host.
    device = "cuda"


def test_importing_does_not_import_triton():
    code = "import sys, openprime.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# The opt-in C++ path (native_ops): building it takes about 20 s the first time, so these run only with
# OPENPRIME_INT8_NATIVE=1 (which also sends the codec and ring tests above through it); the torch path
# needs no compilation and is what the default run checks.
native = pytest.mark.skipif(not native_ops.enabled(), reason=f"set {native_ops.ENV_FLAG}=1 to build and test it")


@native
def test_native_builds_and_dispatch_sends_cpu_tensors_to_it():
    assert native_ops.extension() is not None, "OPENPRIME_INT8_NATIVE=1 but the extension did not build (see the log)"
    assert backend_for(torch.zeros(3)) is native_ops


@native
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SIZES + [1 << 20])
def test_native_matches_reference(kind, n):
    x = make(kind, n)
    codes_ref, codebook_ref = reference.quantize_int8(x)
    codes, codebook = native_ops.quantize_int8(x)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert codebook.dtype == torch.float32 and codebook.shape == (NUM_BUCKETS,)
    assert torch.equal(codes, codes_ref)
    assert ulps(codebook, codebook_ref) <= 1
    acc = make("normal", n, seed=1)
    assert torch.equal(native_ops.dequantize_add_(acc.clone(), codes, codebook),
                       reference.dequantize_add_(acc.clone(), codes, codebook))
    assert torch.equal(native_ops.dequantize_int8(codes, codebook), reference.dequantize_int8(codes, codebook))


@native
def test_native_statistics_hold_with_a_first_value_far_from_the_mean():
    """The pivot is the first value: 30 among values of 1e-3 makes S and Q large and sigma^2 their difference. The
    C++ lane sums over a whole 2^20-value segment lost ~2e-9 of sigma there, and 9 codes differed from the
    reference (seed 17; review of 2026-12-07); blocks of 4096 into compensated totals keep it to the last bits."""
    n = 1 << 20
    x = torch.randn(n, generator=torch.Generator().manual_seed(17)) * 1e-3
    x[0] = 30.0
    _, pivot, s_ref, q_ref = reference.stats(x)
    p, s, q = native_ops.extension().stats(x)
    assert p == pivot and abs(s - s_ref) <= 1e-14 * abs(s_ref) and abs(q - q_ref) <= 1e-14 * abs(q_ref)
    codes_ref, _ = reference.quantize_int8(x)
    assert torch.equal(native_ops.quantize_int8(x)[0], codes_ref)


@native
@pytest.mark.parametrize("kind", ["normal", "offset", "cauchy", "zeros"])
@pytest.mark.parametrize("n", SIZES + [1 << 20])
def test_native_fused_add_then_quantize_is_the_two_calls(kind, n):
    # The ring's reduce-scatter adds a received chunk in and encodes the sum; the fused C++ takes the sum's
    # statistics while adding. Same sum, same float64 statistics to the last bit, same codes and codebook.
    acc, codes_in, codebook_in = make(kind, n, seed=3), *native_ops.quantize_int8(make("normal", n, seed=4))
    expected_acc = native_ops.dequantize_add_(acc.clone(), codes_in, codebook_in)
    fused_acc = acc.clone()
    codes, codebook = native_ops.dequantize_add_quantize_(fused_acc, codes_in, codebook_in)
    assert torch.equal(fused_acc, expected_acc)
    want_codes, want_codebook = native_ops.quantize_int8(expected_acc)
    assert torch.equal(codes, want_codes) and torch.equal(codebook.view(torch.int32), want_codebook.view(torch.int32))
    if n:
        ext, again = native_ops.extension(), acc.clone()
        assert ext.decode_add_stats(again, codes_in, codebook_in) == ext.stats(expected_acc)
        assert torch.equal(again, expected_acc)


@native
def test_native_given_the_same_range_the_codes_are_bitwise_the_reference():
    x = make("normal", 20_000)
    params = reference.params_of(x)
    edges = torch.tensor([params.lo + k / params.scale for k in range(NUM_BUCKETS + 1)], dtype=torch.float32)
    near = torch.cat([edges, edges.nextafter(torch.tensor(math.inf)), edges.nextafter(torch.tensor(-math.inf))])
    probe = torch.cat([x, near])
    codes, _ = native_ops.bucketize_and_codebook(probe, params)
    assert torch.equal(codes, reference.bucketize(probe, params))


@native
def test_native_noncontiguous_input_and_deterministic_bytes():
    x = make("student_t", 6 * 7001).reshape(6, 7001)
    codes, codebook = native_ops.quantize_int8(x.t())
    codes_ref, _ = reference.quantize_int8(x.t().contiguous())
    assert torch.equal(codes.contiguous(), codes_ref)
    again = native_ops.quantize_int8(x.t())
    assert torch.equal(again[0], codes) and torch.equal(again[1].view(torch.int32), codebook.view(torch.int32))


@native
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_native_rejects_nan_and_inf(bad):
    x = make("normal", 5000)
    x[1234] = bad
    with pytest.raises(ValueError, match=r"NaN/inf.*inner optimizer / learning rate"):
        native_ops.quantize_int8(x)


@native
def test_native_bad_decode_arguments_get_the_torch_paths_errors():
    with pytest.raises(ValueError, match="same size"):
        native_ops.dequantize_add_(torch.zeros(5), torch.zeros(4, dtype=torch.uint8), torch.zeros(NUM_BUCKETS))


def test_a_dead_builds_lock_is_removed_and_a_live_build_waited_for(tmp_path, caplog):
    # torch's builder waits without bound on a lock file left by a build that was killed. Every native build
    # holds an flock first, which dies with its process: a torch lock found under it is a dead build's.
    import threading
    import time

    (tmp_path / "lock").touch()
    with caplog.at_level("WARNING", logger="openprime.kernels.native_ops"), \
            native_ops.exclusive_build(str(tmp_path), wait_s=5):
        assert not (tmp_path / "lock").exists()
    assert "did not finish" in caplog.text

    # Another process building (holding the flock) is waited for, and its death ends the wait.
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                               str(tmp_path / "openprime-build.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TimeoutError, match="building in"), native_ops.exclusive_build(str(tmp_path), wait_s=0.3):
            pass
        killer = threading.Timer(0.8, holder.kill)
        killer.start()
        started = time.monotonic()
        with native_ops.exclusive_build(str(tmp_path), wait_s=30):
            waited = time.monotonic() - started
        killer.join()
        assert 0.7 < waited < 10
    finally:
        holder.kill()
        holder.wait(timeout=10)

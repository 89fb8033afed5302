"""An opt-in C++ path for the int8 quantizer (paper section 2.2) on CPU: the same arithmetic in fused loops.

The torch path (torch_ops) is bound by eager ops: about 14 of them per cache block, two of them scalar
`bincount` loops, about 2.7 ns an element on one core. Here one loop computes the float64 statistics and
one sweep over cache-sized blocks computes the codes and the per-bucket float64 sums and counts (four
interleaved histograms, so that repeated buckets do not serialise on one memory location), and decoding
is a single gather(-add) loop; with AVX2 (the build uses -march=native) the statistics, the codes and the
decoding work on 4-32 values an instruction. The arithmetic is params.py's, so the codes are the reference's
and the codebook differs only where float64 sums in another order round to another fp32 (the tests allow 1 ulp).

It is compiled with torch.utils.cpp_extension on first use (about 20 s, needs a C++ compiler; cached in
torch's extension directory afterwards) and only when asked for: set OPENPRIME_INT8_NATIVE=1. Nothing
compiles at import time, the tests never wait on it unless that variable is set, and a failed build
logs a warning and leaves the torch path in charge. One thread a call (the ring's codec runs on one
core per rank); the GIL is released while the C++ runs, so the transports' threads keep moving.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import time
from collections.abc import Iterator
from types import ModuleType

import torch

from openprime.kernels import torch_ops
from openprime.kernels.params import (
    DEFAULT_RANGE_SIGMAS,
    NUM_BUCKETS,
    QuantParams,
    check_input,
    check_range_sigmas,
    decoders,
    non_finite_error,
    quant_params,
)

log = logging.getLogger(__name__)

ENV_FLAG = "OPENPRIME_INT8_NATIVE"

_SOURCE = r"""
#include <torch/extension.h>
#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace py = pybind11;

// GCC/Clang vector types: one instruction on all lanes; plain C++ arithmetic otherwise.
typedef double v2d __attribute__((vector_size(16)));
typedef double v4d __attribute__((vector_size(32)));

// params.py step 1: S = sum(x - p), Q = sum((x - p)^2) in float64 around the pivot p; x - p is exact in float64.
// Eight interleaved partial sums (two vectors of four lanes: element i goes to lane i mod 8) over blocks of
// GROUPS_PER_BLOCK groups of eight, each block's lanes added in a fixed order into a compensated (Neumaier) total,
// then the values past the last full eight one by one: the same result on every call. Plain lane sums over the whole
// segment lost ~2e-9 (relative) of sigma when the pivot was far from the mean (a first value of 30 among values of
// 1e-3: 9 codes of 2^20 differed from the reference; the torch path sums blocks with fsum, the reference all of it).
constexpr int GROUPS_PER_BLOCK = 512;  // 4096 values: a block's lane sums hold 512 terms each

struct Compensated {  // Neumaier's sum: the total and the rounding errors of its additions, added at the end
  double sum = 0, error = 0;
  void add(double v) {
    const double t = sum + v;
    error += std::abs(sum) >= std::abs(v) ? (sum - t) + v : (v - t) + sum;
    sum = t;
  }
  double value() const { return sum + error; }
};

struct Moments {
  const double pivot;
  const v4d p;
  v4d s0 = {0, 0, 0, 0}, s1 = s0, q0 = s0, q1 = s0;
  int groups = 0;
  Compensated S, Q;

  explicit Moments(double pivot_) : pivot(pivot_), p{pivot_, pivot_, pivot_, pivot_} {}

  // Elements i..i+3 and i+4..i+7 of a group of eight, as float64.
  void add8(v4d d0, v4d d1) {
    d0 -= p;
    d1 -= p;
    s0 += d0;
    s1 += d1;
    q0 += d0 * d0;
    q1 += d1 * d1;
    if (++groups == GROUPS_PER_BLOCK) flush();
  }

  // The block's lane sums into the totals, in a fixed order; the lanes start again from zero.
  void flush() {
    double s = 0, q = 0;
    for (int j = 0; j < 4; j++) { s += s0[j]; q += q0[j]; }
    for (int j = 0; j < 4; j++) { s += s1[j]; q += q1[j]; }
    S.add(s);
    Q.add(q);
    s0 = v4d{0, 0, 0, 0}; s1 = s0; q0 = s0; q1 = s0;
    groups = 0;
  }

  // (p, S, Q), with a[i:n) (fewer than eight) added last.
  std::vector<double> finish(const float* a, int64_t i, int64_t n) {
    flush();
    for (; i < n; i++) {
      const double d = (double)a[i] - pivot;
      S.add(d);
      Q.add(d * d);
    }
    return {pivot, S.value(), Q.value()};
  }
};

// Step 1 for the non-empty x, with the pivot p = x[0].
std::vector<double> stats(const torch::Tensor& x) {
  const float* a = x.data_ptr<float>();
  const int64_t n = x.numel();
  Moments m(a[0]);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    m.add8(v4d{(double)a[i], (double)a[i + 1], (double)a[i + 2], (double)a[i + 3]},
           v4d{(double)a[i + 4], (double)a[i + 5], (double)a[i + 6], (double)a[i + 7]});
  }
  return m.finish(a, i, n);
}

// params.py step 4 for a[b:e): t = (x - lo) * scale in fp32, clamped to [0, 255] (NaN, which the statistics
// have already rejected, to 0 as in the torch path), truncated. With AVX2, 32 values at a time (the same two
// roundings, lane by lane); the scalar loop does the rest and everything without AVX2.
static void codes_block(const float* a, uint8_t* c, int64_t b, int64_t e, float lo, float scale) {
  int64_t i = b;
#ifdef __AVX2__
  const __m256 vlo = _mm256_set1_ps(lo), vscale = _mm256_set1_ps(scale);
  const __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps(255.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' per-lane interleave
  auto codes8 = [&](const float* q) {
    __m256 t = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(q), vlo), vscale);
    t = _mm256_and_ps(t, _mm256_cmp_ps(t, zero, _CMP_GE_OQ));  // !(t >= 0), NaN included -> 0
    return _mm256_cvttps_epi32(_mm256_min_ps(t, top));
  };
  for (; i + 32 <= e; i += 32) {
    const __m256i w01 = _mm256_packus_epi32(codes8(a + i), codes8(a + i + 8));  // in [0, 255]: packs are exact
    const __m256i w23 = _mm256_packus_epi32(codes8(a + i + 16), codes8(a + i + 24));
    _mm256_storeu_si256((__m256i*)(c + i), _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w01, w23), order));
  }
#endif
  for (; i < e; i++) {
    float t = (a[i] - lo) * scale;
    t = !(t >= 0.f) ? 0.f : (t > 255.f ? 255.f : t);
    c[i] = (uint8_t)(int32_t)t;
  }
}

// params.py steps 4 and 5: the codes of a cache-sized block, then its per-bucket float64 sums and counts
// while it is in L1. A bucket's sum and count are one 16-byte pair {sum, count} (a count as a double is
// exact below 2^53), so each value costs one load-add-store; four interleaved histograms, so that repeated
// buckets do not serialise on one memory location. Returns (codes, codebook): a bucket's mean rounded to
// fp32, or for an empty bucket its centre fp32(lo64 + (k + 0.5) * step64), as params.finish_codebook.
std::vector<torch::Tensor> bucketize(const torch::Tensor& x, double lo64, double scale64, double centre_lo64,
                                     double step64) {
  const float* a = x.data_ptr<float>();
  const int64_t n = x.numel();
  torch::Tensor codes = torch::empty({n}, torch::kUInt8);
  torch::Tensor codebook = torch::empty({256}, torch::kFloat32);
  uint8_t* c = codes.data_ptr<uint8_t>();
  const float lo = (float)lo64, scale = (float)scale64;
  constexpr int64_t kBlock = 4096;
  constexpr int kWays = 4;
  alignas(64) v2d h[kWays][256];
  std::memset(h, 0, sizeof(h));
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    codes_block(a, c, b, e, lo, scale);
    int64_t i = b;
    for (; i + kWays <= e; i += kWays) {
      for (int j = 0; j < kWays; j++) {
        const v2d v = {(double)a[i + j], 1.0};
        h[j][c[i + j]] += v;
      }
    }
    for (; i < e; i++) {
      const v2d v = {(double)a[i], 1.0};
      h[0][c[i]] += v;
    }
  }
  float* cb = codebook.data_ptr<float>();
  for (int k = 0; k < 256; k++) {
    const double sum = ((h[0][k][0] + h[1][k][0]) + h[2][k][0]) + h[3][k][0];
    const double count = ((h[0][k][1] + h[1][k][1]) + h[2][k][1]) + h[3][k][1];
    cb[k] = (float)(count > 0 ? sum / count : ((double)k + 0.5) * step64 + centre_lo64);
  }
  return {codes, codebook};
}

#ifdef __AVX2__
// The table entries of the eight codes at c, as one vector: one 64-bit load, eight scalar lookups.
static inline __m256 lookup8(const float* cb, const uint8_t* c) {
  uint64_t w;
  std::memcpy(&w, c, 8);
  return _mm256_setr_ps(cb[w & 255], cb[(w >> 8) & 255], cb[(w >> 16) & 255], cb[(w >> 24) & 255],
                        cb[(w >> 32) & 255], cb[(w >> 40) & 255], cb[(w >> 48) & 255], cb[w >> 56]);
}
#endif

// out = codebook[codes], or out += codebook[codes], in fp32. With AVX2, eight codes at a time are read as
// one 64-bit word and their eight table entries become one vector, added and stored at once (one store per
// eight values rather than per value: 0.29 against 0.46 ns a value here); the scalar loop does the rest.
void decode(torch::Tensor& out, const torch::Tensor& codes, const torch::Tensor& codebook, bool accumulate) {
  float* o = out.data_ptr<float>();
  const uint8_t* c = codes.data_ptr<uint8_t>();
  alignas(64) float cb[256];
  std::copy(codebook.data_ptr<float>(), codebook.data_ptr<float>() + 256, cb);
  const int64_t n = out.numel();
  int64_t i = 0;
#ifdef __AVX2__
  for (; i + 8 <= n; i += 8) {
    __m256 v = lookup8(cb, c + i);
    if (accumulate) v = _mm256_add_ps(_mm256_loadu_ps(o + i), v);
    _mm256_storeu_ps(o + i, v);
  }
#endif
  if (accumulate) {
    for (; i < n; i++) o[i] += cb[c[i]];
  } else {
    for (; i < n; i++) o[i] = cb[c[i]];
  }
}

// out += codebook[codes], then stats(out) (same lanes, same order, same result) while the sums are still in
// registers: the ring's reduce-scatter encodes every chunk it has just added into, and this saves that
// encoding a pass over the chunk and a call (alone, a 2^20 segment: 0.42 ms against 0.27 + 0.17 ms for the
// two calls; both are bound by instructions more than by memory). Without AVX2: decode, then stats.
std::vector<double> decode_add_stats(torch::Tensor& out, const torch::Tensor& codes, const torch::Tensor& codebook) {
#ifdef __AVX2__
  float* o = out.data_ptr<float>();
  const uint8_t* c = codes.data_ptr<uint8_t>();
  alignas(64) float cb[256];
  std::copy(codebook.data_ptr<float>(), codebook.data_ptr<float>() + 256, cb);
  const int64_t n = out.numel();
  Moments m(o[0] + cb[c[0]]);  // the pivot is the sum's first value
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_add_ps(_mm256_loadu_ps(o + i), lookup8(cb, c + i));
    _mm256_storeu_ps(o + i, v);
    m.add8(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
  }
  for (int64_t k = i; k < n; k++) o[k] += cb[c[k]];
  return m.finish(o, i, n);
#else
  decode(out, codes, codebook, true);
  return stats(out);
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stats", &stats, py::call_guard<py::gil_scoped_release>());
  m.def("bucketize", &bucketize, py::call_guard<py::gil_scoped_release>());
  m.def("decode", &decode, py::call_guard<py::gil_scoped_release>());
  m.def("decode_add_stats", &decode_add_stats, py::call_guard<py::gil_scoped_release>());
}
"""

# -ffp-contract=off: no FMA contraction, so every rounding is the one params.py writes down.
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off"]


def enabled() -> bool:
    """Whether the caller asked for this path (OPENPRIME_INT8_NATIVE=1)."""
    return os.environ.get(ENV_FLAG, "") not in ("", "0")


def _cpu_signature() -> str:
    # -march=native binds the build to this CPU: a shared extension cache must not hand it to another.
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


# torch's extension builder takes a lock file in the build directory, and every other process waits for it
# to go, with no bound and no message: a build killed midway (a node killed while it built, Ctrl-C) would
# leave every later start waiting for ever. So every build here first takes an flock of its own on a file
# beside it, which the kernel releases when its holder dies: while a process holds it no other is building,
# and a torch lock found then is a dead build's. The wait for a live build is bounded; past it the torch path
# serves. A build takes 20-35 s on 2 cores.
BUILD_WAIT_S = 600.0
_LOCK_POLL_S = 0.5


@functools.cache
def extension() -> ModuleType | None:
    """The compiled extension (built on the first call), or None if it cannot be built here."""
    from torch.utils.cpp_extension import get_default_build_root, load_inline

    # torch's install is in the name: the build files name its headers, so two environments sharing the cache
    # directory would otherwise rebuild each other's extension each time they alternate.
    digest = hashlib.sha256((_SOURCE + " ".join(_CFLAGS) + _cpu_signature() + torch.__file__).encode()).hexdigest()
    name = f"openprime_int8_{digest[:16]}"
    try:
        build_dir = os.path.join(get_default_build_root(), name)
        os.makedirs(build_dir, exist_ok=True)
        with exclusive_build(build_dir):
            return load_inline(name, cpp_sources=[_SOURCE], extra_cflags=_CFLAGS, build_directory=build_dir)
    except Exception as e:  # no compiler, no headers, another build that did not finish in time: the torch path
        log.warning("openprime.kernels: could not build the native int8 path (%s); using the torch path", e)
        return None


@contextlib.contextmanager
def exclusive_build(build_dir: str, wait_s: float = BUILD_WAIT_S) -> Iterator[None]:
    """Hold the flock of `build_dir` (waiting at most `wait_s` for another process's build to end; TimeoutError
    after that) and, under it, remove torch's lock file if a dead build left one. POSIX only (fcntl): elsewhere
    the ImportError sends extension() to the torch path."""
    import fcntl

    with open(os.path.join(build_dir, "openprime-build.lock"), "a") as f:
        deadline, said = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building in {build_dir} for over {wait_s:.0f} s; "
                                       "if none is, remove that directory") from None
                if not said:
                    log.info("openprime.kernels: another process is building the native int8 path in %s; waiting "
                             "for it (at most %.0f s)", build_dir, wait_s)
                    said = True
                time.sleep(_LOCK_POLL_S)
        try:
            torch_lock = os.path.join(build_dir, "lock")
            if os.path.exists(torch_lock):
                log.warning("openprime.kernels: removing %s, left by a build of the native int8 path that did not "
                            "finish (its process is gone); building again", torch_lock)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(torch_lock)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def available() -> bool:
    """Opted in and built (building it now if needed)."""
    return enabled() and extension() is not None


def bucketize_and_codebook(x_N: torch.Tensor, params: QuantParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 4 and 5 for the flat, non-empty fp32 CPU chunk: (codes_N uint8, codebook_K fp32)."""
    ext = extension()
    if ext is None or x_N.numel() == 0:
        return torch_ops.bucketize_and_codebook(x_N, params)
    return _bucketize(ext, x_N.contiguous(), params)


# The ring calls the codec on every 2^20-value segment, and each torch call from Python lets the transports'
# threads take the GIL: a flat contiguous CPU tensor, the ring's case, goes to the C++ calls as it is (two
# calls to encode, one to decode, each holding the GIL only to enter and leave), and anything else is
# reshaped first.


def quantize_int8(x: torch.Tensor, range_sigmas: float = DEFAULT_RANGE_SIGMAS) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 of x's shape, codebook float32 (256,)) for the fp32 CPU chunk x."""
    check_input(x)
    ext = extension()
    if ext is None or x.device.type != "cpu" or x.numel() == 0:
        return torch_ops.quantize_int8(x, range_sigmas)
    flat = x.dim() == 1 and x.is_contiguous()
    x_N = x if flat else x.detach().reshape(-1).contiguous()
    codes_N, codebook_K = _bucketize(ext, x_N, _params(x_N, ext.stats(x_N), range_sigmas))
    return (codes_N if flat else codes_N.reshape(x.shape)), codebook_K


def dequantize_add_quantize_(acc: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor,
                             range_sigmas: float = DEFAULT_RANGE_SIGMAS) -> tuple[torch.Tensor, torch.Tensor]:
    """acc += codebook[codes], then quantize_int8(acc), with the statistics taken in the adding pass."""
    ext = extension()
    if ext is None or not _fusable(acc, codes, codebook) or acc.dim() != 1:
        _decode(acc, codes, codebook, True)
        return quantize_int8(acc, range_sigmas)
    return _bucketize(ext, acc, _params(acc, ext.decode_add_stats(acc, codes, codebook), range_sigmas))


def _params(x_N: torch.Tensor, sums: tuple[float, float, float], range_sigmas: float) -> QuantParams:
    """Steps 2-3 for the flat chunk x_N whose statistics (pivot, S, Q) the C++ has taken."""
    params = quant_params(x_N.numel(), *sums, check_range_sigmas(range_sigmas))
    if params is None:
        raise non_finite_error(x_N)
    return params


def _bucketize(ext: ModuleType, x_N: torch.Tensor, params: QuantParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 4-5 in C++: (codes_N, codebook_K)."""
    codes_N, codebook_K = ext.bucketize(x_N, params.lo, params.scale, params.lo64, params.step64)
    return codes_N, codebook_K


def _fusable(out: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor) -> bool:
    """Whether the C++ decoding takes these as they are: contiguous CPU fp32 `out`, uint8 codes, 256 fp32."""
    return (out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous() and out.numel() > 0
            and codes.device.type == "cpu" and codes.dtype == torch.uint8 and codes.is_contiguous()
            and codes.numel() == out.numel() and codebook.device.type == "cpu" and codebook.dtype == torch.float32
            and codebook.is_contiguous() and codebook.numel() == NUM_BUCKETS)


def _decode(out: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor, accumulate: bool) -> torch.Tensor:
    ext = extension()
    if ext is None or out.device.type != "cpu" or out.dtype != torch.float32 or codes.dtype != torch.uint8 \
            or out.numel() != codes.numel() or not out.is_contiguous() or codebook.numel() != NUM_BUCKETS:
        return torch_ops._decode(out, codes, codebook, accumulate)  # its checks and errors
    if not _fusable(out, codes, codebook):
        codes = codes.reshape(-1).to("cpu").contiguous()
        codebook = codebook.to(device="cpu", dtype=torch.float32).contiguous()
    ext.decode(out, codes, codebook, accumulate)
    return out


dequantize_add_, dequantize_into_, dequantize_int8 = decoders(_decode)

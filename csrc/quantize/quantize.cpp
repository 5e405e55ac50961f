// Block-wise symmetric int8 quantization of CPU tensors (ZeRO++'s quantized communication).
//
// A flat tensor of n elements is cut into blocks of `block` elements (the last one may be shorter).
// Each block b gets one fp32 scale and its elements one int8 each:
//
//   absmax[b] = max |x_i| over the block            (exact, whatever the order)
//   scale[b]  = absmax[b] / 127                      (one IEEE division)
//   q_i       = clamp(round_half_even(x_i / scale[b]), -127, 127)
//   dequant   = q_i * scale[b]                        (one IEEE multiply; rounded to nearest even
//                                                    when the output is bf16/fp16)
//
// Edge cases, decided here and mirrored by the oracle (zerotrain/ops/quantize_reference.py):
//   * an all-zero block has scale 0 and q = 0 (it dequantizes to exact zeros);
//   * a block holding any inf or NaN gets scale NaN and q = 0, so it dequantizes to NaN in every
//     element: a non-finite value is never silently clipped to +-127 * scale, and the loss
//     scaler's overflow check still sees it after a quantized reduction.
// Every operation is correctly rounded IEEE arithmetic on independent elements, so the result is
// bit-identical across the ISA paths, the thread count and the oracle: the tests demand it.
//
// Inputs: fp32, bf16 or fp16; dequantized output: fp32, bf16 or fp16. ISA: like cpu_adam.cpp, the
// `isa` argument, else $ZEROTRAIN_QUANTIZE_ISA, else the best the CPU supports (csrc/includes/
// isa.h). Blocks are spread over torch's intra-op threads.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "isa.h"
#include "simd.h"

namespace zerotrain {
namespace {

using isa::Isa;
using simd::Bf16;
using simd::Fp16;

constexpr const char* kIsaEnv = "ZEROTRAIN_QUANTIZE_ISA";

// What the quantizer needs per ISA beyond simd.h: |x|, max, a mask of non-finite lanes, the
// round-clamp-narrow store to int8 and the widening int8 load. M is a lane mask.
template <class S>
struct Q;

template <>
struct Q<simd::Scalar> {
  using V = float;
  using M = bool;
  static inline V zero() { return 0.0f; }
  static inline M none() { return false; }
  static inline V abs(V x) { return std::fabs(x); }
  static inline V max(V a, V b) { return a > b ? a : b; }  // NaN lanes are caught by `nonfinite`
  static inline M nonfinite(V a) { return !(a < std::numeric_limits<float>::infinity()); }
  static inline M lor(M a, M b) { return a || b; }
  static inline bool any(M m) { return m; }
  static inline float hmax(V a) { return a; }
  static inline void store_q(int8_t* p, V x) {
    const float r = std::min(127.0f, std::max(-127.0f, std::nearbyint(x)));
    *p = static_cast<int8_t>(r);
  }
  static inline V load_q(const int8_t* p) { return static_cast<float>(*p); }
};

#if ZT_SIMD_X86
template <>
struct Q<simd::Avx2> {
  using V = __m256;
  using M = __m256;
  ZT_TARGET_AVX2 static inline V zero() { return _mm256_setzero_ps(); }
  ZT_TARGET_AVX2 static inline M none() { return _mm256_setzero_ps(); }
  ZT_TARGET_AVX2 static inline V abs(V x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
  ZT_TARGET_AVX2 static inline V max(V a, V b) { return _mm256_max_ps(a, b); }
  ZT_TARGET_AVX2 static inline M nonfinite(V a) {
    return _mm256_cmp_ps(a, _mm256_set1_ps(std::numeric_limits<float>::infinity()), _CMP_NLT_UQ);
  }
  ZT_TARGET_AVX2 static inline M lor(M a, M b) { return _mm256_or_ps(a, b); }
  ZT_TARGET_AVX2 static inline bool any(M m) { return _mm256_movemask_ps(m) != 0; }
  ZT_TARGET_AVX2 static inline float hmax(V a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  ZT_TARGET_AVX2 static inline void store_q(int8_t* p, V x) {
    V r = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_min_ps(_mm256_set1_ps(127.0f), _mm256_max_ps(_mm256_set1_ps(-127.0f), r));
    const __m256i i = _mm256_cvttps_epi32(r);
    // values are in [-127, 127]: the saturating packs are exact
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }
  ZT_TARGET_AVX2 static inline V load_q(const int8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
};

template <>
struct Q<simd::Avx512> {
  using V = __m512;
  using M = __mmask16;
  ZT_TARGET_AVX512 static inline V zero() { return _mm512_setzero_ps(); }
  ZT_TARGET_AVX512 static inline M none() { return 0; }
  ZT_TARGET_AVX512 static inline V abs(V x) { return _mm512_abs_ps(x); }
  ZT_TARGET_AVX512 static inline V max(V a, V b) { return _mm512_max_ps(a, b); }
  ZT_TARGET_AVX512 static inline M nonfinite(V a) {
    return _mm512_cmp_ps_mask(a, _mm512_set1_ps(std::numeric_limits<float>::infinity()),
                              _CMP_NLT_UQ);
  }
  ZT_TARGET_AVX512 static inline M lor(M a, M b) { return static_cast<M>(a | b); }
  ZT_TARGET_AVX512 static inline bool any(M m) { return m != 0; }
  ZT_TARGET_AVX512 static inline float hmax(V a) { return _mm512_reduce_max_ps(a); }
  ZT_TARGET_AVX512 static inline void store_q(int8_t* p, V x) {
    V r = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_min_ps(_mm512_set1_ps(127.0f), _mm512_max_ps(_mm512_set1_ps(-127.0f), r));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(r)));
  }
  ZT_TARGET_AVX512 static inline V load_q(const int8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
};
#endif  // ZT_SIMD_X86

// One call's buffers: `x` (T) -> `q`, `scales`; or `q`, `scales` -> `out` (T).
struct Args {
  const void* x = nullptr;
  int8_t* q = nullptr;
  float* scales = nullptr;
  void* out = nullptr;
  int64_t numel = 0;
  int64_t block = 0;
};

// |x| max of one block and whether it holds a non-finite value. A tail shorter than a vector goes
// through a zero-padded copy (zeros change neither result).
template <class S, class T>
inline float block_absmax(const T* x, int64_t n, bool* nonfinite) {
  using QS = Q<S>;
  constexpr int W = S::kWidth;
  typename QS::V amax = QS::zero();
  typename QS::M bad = QS::none();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const auto a = QS::abs(S::load(x + i));
    bad = QS::lor(bad, QS::nonfinite(a));
    amax = QS::max(amax, a);
  }
  if (i < n) {
    T tail[W] = {};
    std::copy(x + i, x + n, tail);
    const auto a = QS::abs(S::load(tail));
    bad = QS::lor(bad, QS::nonfinite(a));
    amax = QS::max(amax, a);
  }
  *nonfinite = QS::any(bad);
  return QS::hmax(amax);
}

template <class S, class T>
inline void quantize_blocks(const Args& a, int64_t b0, int64_t b1) {
  constexpr int W = S::kWidth;
  const T* x = static_cast<const T*>(a.x);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t begin = b * a.block;
    const int64_t n = std::min(a.block, a.numel - begin);
    const T* xb = x + begin;
    int8_t* qb = a.q + begin;
    bool nonfinite = false;
    const float absmax = block_absmax<S, T>(xb, n, &nonfinite);
    if (nonfinite) {
      a.scales[b] = std::numeric_limits<float>::quiet_NaN();
      std::memset(qb, 0, static_cast<size_t>(n));
      continue;
    }
    const float scale = absmax / 127.0f;
    a.scales[b] = scale;
    const auto div = S::set1(scale == 0.0f ? 1.0f : scale);  // an all-zero block: q = 0 / 1
    int64_t i = 0;
    for (; i + W <= n; i += W) Q<S>::store_q(qb + i, S::div(S::load(xb + i), div));
    if (i < n) {
      T tail[W] = {};
      int8_t qt[W];
      std::copy(xb + i, xb + n, tail);
      Q<S>::store_q(qt, S::div(S::load(tail), div));
      std::copy(qt, qt + (n - i), qb + i);
    }
  }
}

template <class S, class T>
inline void dequantize_blocks(const Args& a, int64_t b0, int64_t b1) {
  constexpr int W = S::kWidth;
  T* out = static_cast<T*>(a.out);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t begin = b * a.block;
    const int64_t n = std::min(a.block, a.numel - begin);
    const int8_t* qb = a.q + begin;
    T* ob = out + begin;
    const auto scale = S::set1(a.scales[b]);
    int64_t i = 0;
    for (; i + W <= n; i += W) S::store(ob + i, S::mul(Q<S>::load_q(qb + i), scale));
    if (i < n) {
      int8_t qt[W] = {};
      T ot[W];
      std::copy(qb + i, qb + n, qt);
      S::store(ot, S::mul(Q<S>::load_q(qt), scale));
      std::copy(ot, ot + (n - i), ob + i);
    }
  }
}

using BlocksFn = void (*)(const Args&, int64_t, int64_t);

// One wrapper per ISA; `flatten` inlines the kernel and S's target-specific members into a
// function compiled for that ISA (see simd.h).
template <class T, bool kQuantize>
__attribute__((flatten)) void blocks_scalar(const Args& a, int64_t b0, int64_t b1) {
  if constexpr (kQuantize) {
    quantize_blocks<simd::Scalar, T>(a, b0, b1);
  } else {
    dequantize_blocks<simd::Scalar, T>(a, b0, b1);
  }
}
#if ZT_SIMD_X86
template <class T, bool kQuantize>
ZT_TARGET_AVX2 __attribute__((flatten)) void blocks_avx2(const Args& a, int64_t b0, int64_t b1) {
  if constexpr (kQuantize) {
    quantize_blocks<simd::Avx2, T>(a, b0, b1);
  } else {
    dequantize_blocks<simd::Avx2, T>(a, b0, b1);
  }
}
template <class T, bool kQuantize>
ZT_TARGET_AVX512 __attribute__((flatten)) void blocks_avx512(const Args& a, int64_t b0,
                                                             int64_t b1) {
  if constexpr (kQuantize) {
    quantize_blocks<simd::Avx512, T>(a, b0, b1);
  } else {
    dequantize_blocks<simd::Avx512, T>(a, b0, b1);
  }
}
#endif

template <bool kQuantize, class T>
BlocksFn pick_isa(Isa isa) {
#if ZT_SIMD_X86
  if (isa == Isa::kAvx512) return &blocks_avx512<T, kQuantize>;
  if (isa == Isa::kAvx2) return &blocks_avx2<T, kQuantize>;
#endif
  return &blocks_scalar<T, kQuantize>;
}

template <bool kQuantize>
BlocksFn pick_kernel(Isa isa, at::ScalarType t) {
  if (t == at::kBFloat16) return pick_isa<kQuantize, Bf16>(isa);
  if (t == at::kHalf) return pick_isa<kQuantize, Fp16>(isa);
  return pick_isa<kQuantize, float>(isa);
}

// ------------------------------------------------------------------------------------------------
// Checks and entry points
// ------------------------------------------------------------------------------------------------
int64_t num_blocks(int64_t numel, int64_t block) { return (numel + block - 1) / block; }

void check_buffer(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "quantize: ", name, "=", t.device(),
                    ": not a CPU tensor; valid: CPU tensors (CUDA ones go to quantize.cu)");
  TORCH_CHECK_VALUE(t.is_contiguous(), "quantize: ", name,
                    ": not contiguous; valid: a contiguous (flat) tensor");
  TORCH_CHECK_VALUE(t.numel() == numel, "quantize: ", name, ".numel()=", t.numel(),
                    ": does not match the data; valid: ", numel);
}

void check_float(const at::Tensor& t, const char* name) {
  const auto st = t.scalar_type();
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "quantize: ", name,
                   ".dtype=", st, ": unsupported; valid: float32, bfloat16, float16");
}

void check_codes(const at::Tensor& q, const at::Tensor& scales, int64_t numel, int64_t block) {
  TORCH_CHECK_VALUE(block >= 1, "quantize: block=", block, ": must be positive; valid: >= 1");
  TORCH_CHECK_TYPE(q.scalar_type() == at::kChar, "quantize: q.dtype=", q.scalar_type(),
                   ": valid: int8");
  TORCH_CHECK_TYPE(scales.scalar_type() == at::kFloat, "quantize: scales.dtype=",
                   scales.scalar_type(), ": valid: float32");
  check_buffer(q, "q", numel);
  check_buffer(scales, "scales", num_blocks(numel, block));
}

void run_blocks(BlocksFn fn, const Args& a) {
  const int64_t blocks = num_blocks(a.numel, a.block);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / a.block);  // >= 32K elements
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) { fn(a, b0, b1); });
}

// The float tensor `data` (quantize: the input x; dequantize: the output) and its codes, all
// preallocated: checks them, then runs the blocks on the chosen ISA.
template <bool kQuantize>
void run(const at::Tensor& data, const char* name, const at::Tensor& q, const at::Tensor& scales,
         int64_t block, const std::string& isa_request) {
  check_float(data, name);
  check_buffer(data, name, data.numel());
  check_codes(q, scales, data.numel(), block);
  const Isa isa = isa::resolve_isa(isa_request, kIsaEnv);
  if (data.numel() == 0) return;
  Args a;
  a.x = a.out = data.data_ptr();  // the kernel reads x or writes out, by kQuantize
  a.q = q.data_ptr<int8_t>();
  a.scales = scales.data_ptr<float>();
  a.numel = data.numel();
  a.block = block;
  run_blocks(pick_kernel<kQuantize>(isa, data.scalar_type()), a);
}

// x -> q (int8, x's numel) and scales (fp32, one per block).
void quantize(at::Tensor x, at::Tensor q, at::Tensor scales, int64_t block,
              const std::string& isa_request) {
  run<true>(x, "x", q, scales, block, isa_request);
}

// q, scales -> out (fp32, bf16 or fp16, q's numel).
void dequantize(at::Tensor q, at::Tensor scales, at::Tensor out, int64_t block,
                const std::string& isa_request) {
  run<false>(out, "out", q, scales, block, isa_request);
}

std::string selected_isa(const std::string& requested) {
  return isa::isa_name(isa::resolve_isa(requested, kIsaEnv));
}

}  // namespace
}  // namespace zerotrain

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "zerotrain block-wise int8 quantization for CPU tensors (see quantize.cpp)";
  m.def("quantize", &zerotrain::quantize, py::arg("x"), py::arg("q"), py::arg("scales"),
        py::arg("block"), py::arg("isa"), py::call_guard<py::gil_scoped_release>(),
        "x -> int8 codes and fp32 per-block scales; see zerotrain.ops.quantize_blockwise.");
  m.def("dequantize", &zerotrain::dequantize, py::arg("q"), py::arg("scales"), py::arg("out"),
        py::arg("block"), py::arg("isa"), py::call_guard<py::gil_scoped_release>(),
        "int8 codes and per-block scales -> out; see zerotrain.ops.dequantize_blockwise.");
  m.def("selected_isa", &zerotrain::selected_isa, py::arg("requested") = "",
        "The ISA a call with this `isa` argument would use (honours $ZEROTRAIN_QUANTIZE_ISA).");
  m.def("supported_isas", &zerotrain::isa::supported_isas, "ISA paths this CPU can run, best first.");
}

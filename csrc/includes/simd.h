// A small SIMD abstraction for the CPU optimizer kernels.
//
// Three "ISA" structs expose the same static interface so that one kernel template can be written
// once and instantiated per instruction set:
//
//   Avx512  16 fp32 lanes  (AVX-512F; fp16 via the AVX-512F vcvtph2ps/vcvtps2ph forms)
//   Avx2     8 fp32 lanes  (AVX2 + FMA + F16C)
//   Scalar   1 lane        (portable C++; the compiler may still auto-vectorise it with SSE2)
//
// Interface of each struct S (V: fp32 vector, VI: uint32 vector):
//   S::kWidth, S::kName
//   V  S::set1(float), S::load(const float*|const Bf16*|const Fp16*)   (unaligned loads)
//   void S::store(float*|Bf16*|Fp16*, V)                                (unaligned stores; bf16 and
//                                                                       fp16 round to nearest even)
//   void S::store_sr(Bf16*, V, VI random_bits)   bf16 with stochastic rounding (low 16 bits used)
//   V  S::add/sub/mul/div/sqrt, S::fmadd(a,b,c) = a*b+c, S::fnmadd(a,b,c) = c-a*b
//   VI S::iota(uint32 base) = base, base+1, ...;  S::vi_set1, vi_add, vi_mul (low 32 bits), vi_xor,
//      vi_srl<k>
//
// No function here is compiled with global -m flags. Each vector struct's members carry a GCC/Clang
// `target` attribute, so one object file holds all paths and the caller picks one at run time. A
// kernel template that uses S must be inlined into a function carrying the same target attribute
// (cpu_adam.cpp does this with `flatten` wrappers); calling S's members from plain code would not
// inline them.
//
// Rounding:
//   fp32 -> bf16 (store):    round to nearest, ties to even; NaN -> 0x7FC0 (quiet NaN, like
//                            c10::BFloat16's scalar conversion); overflow rounds to +-inf.
//   fp32 -> bf16 (store_sr): adds 16 random bits below the bf16 mantissa, then truncates
//                            (unbiased stochastic rounding); NaN -> 0x7FC0.
//   fp32 -> fp16 (store):    IEEE round to nearest even, subnormals kept, overflow -> +-inf.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define ZT_SIMD_X86 1
#include <immintrin.h>
#else
#define ZT_SIMD_X86 0
#endif

namespace zerotrain {
namespace simd {

// 16-bit storage types; layout-compatible with c10::BFloat16 and c10::Half.
struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};

// ---------------------------------------------------------------------------------------------
// Scalar conversions (used by the Scalar path and as the definition the vector paths must match).
// ---------------------------------------------------------------------------------------------
inline uint32_t f32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}
inline float bits_f32(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16_rne(float x) {
  if (std::isnan(x)) return 0x7FC0;
  const uint32_t u = f32_bits(x);
  const uint32_t bias = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + bias) >> 16);
}

inline uint16_t f32_to_bf16_sr(float x, uint32_t random_bits) {
  if (std::isnan(x)) return 0x7FC0;
  return static_cast<uint16_t>((f32_bits(x) + (random_bits & 0xFFFFu)) >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return bits_f32(sign | 0x7F800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {                                                        // zero / subnormal
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    return bits_f32(sign | f32_bits(mag));
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t f32_to_f16_rne(float x) {
  uint32_t u = f32_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7FFFFFFFu;
  if (u >= (143u << 23)) {  // |x| >= 2^16, inf or NaN
    return sign | (u > 0x7F800000u ? 0x7E00u : 0x7C00u);
  }
  if (u < (113u << 23)) {  // |x| < 2^-14: fp16 subnormal or zero
    // Adding 0.5f puts the fp16 subnormal ulp (2^-24) at the fp32 ulp of 0.5, so the FPU's own
    // round-to-nearest-even does the rounding.
    const float t = bits_f32(u) + 0.5f;
    return sign | static_cast<uint16_t>(f32_bits(t) - f32_bits(0.5f));
  }
  const uint32_t mant_odd = (u >> 13) & 1u;
  u += 0xC8000FFFu + mant_odd;  // re-bias exponent (-112 << 23) and round half to even
  return sign | static_cast<uint16_t>(u >> 13);  // a carry into exponent 31 gives inf, correctly
}

// ---------------------------------------------------------------------------------------------
// Scalar path
// ---------------------------------------------------------------------------------------------
struct Scalar {
  using V = float;
  using VI = uint32_t;
  static constexpr int kWidth = 1;
  static constexpr const char* kName = "scalar";

  static inline V set1(float x) { return x; }
  static inline V load(const float* p) { return *p; }
  static inline V load(const Bf16* p) { return bf16_to_f32(p->bits); }
  static inline V load(const Fp16* p) { return f16_to_f32(p->bits); }
  static inline void store(float* p, V v) { *p = v; }
  static inline void store(Bf16* p, V v) { p->bits = f32_to_bf16_rne(v); }
  static inline void store(Fp16* p, V v) { p->bits = f32_to_f16_rne(v); }
  static inline void store_sr(Bf16* p, V v, VI r) { p->bits = f32_to_bf16_sr(v, r); }

  static inline V add(V a, V b) { return a + b; }
  static inline V sub(V a, V b) { return a - b; }
  static inline V mul(V a, V b) { return a * b; }
  static inline V div(V a, V b) { return a / b; }
  static inline V sqrt(V a) { return std::sqrt(a); }
  static inline V fmadd(V a, V b, V c) { return a * b + c; }
  static inline V fnmadd(V a, V b, V c) { return c - a * b; }

  static inline VI iota(uint32_t base) { return base; }
  static inline VI vi_set1(uint32_t x) { return x; }
  static inline VI vi_add(VI a, VI b) { return a + b; }
  static inline VI vi_mul(VI a, VI b) { return a * b; }
  static inline VI vi_xor(VI a, VI b) { return a ^ b; }
  template <int k>
  static inline VI vi_srl(VI a) { return a >> k; }
};

#if ZT_SIMD_X86

#define ZT_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ZT_TARGET_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C path
// ---------------------------------------------------------------------------------------------
struct Avx2 {
  using V = __m256;
  using VI = __m256i;
  static constexpr int kWidth = 8;
  static constexpr const char* kName = "avx2";

  ZT_TARGET_AVX2 static inline V set1(float x) { return _mm256_set1_ps(x); }
  ZT_TARGET_AVX2 static inline V load(const float* p) { return _mm256_loadu_ps(p); }
  ZT_TARGET_AVX2 static inline V load(const Bf16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  ZT_TARGET_AVX2 static inline V load(const Fp16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  ZT_TARGET_AVX2 static inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  ZT_TARGET_AVX2 static inline void store(Bf16* p, V v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
    store_upper_halves(p, _mm256_add_epi32(u, bias), v);
  }
  ZT_TARGET_AVX2 static inline void store_sr(Bf16* p, V v, VI r) {
    const __m256i noise = _mm256_and_si256(r, _mm256_set1_epi32(0xFFFF));
    store_upper_halves(p, _mm256_add_epi32(_mm256_castps_si256(v), noise), v);
  }
  ZT_TARGET_AVX2 static inline void store(Fp16* p, V v) {
    const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }

  ZT_TARGET_AVX2 static inline V add(V a, V b) { return _mm256_add_ps(a, b); }
  ZT_TARGET_AVX2 static inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  ZT_TARGET_AVX2 static inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  ZT_TARGET_AVX2 static inline V div(V a, V b) { return _mm256_div_ps(a, b); }
  ZT_TARGET_AVX2 static inline V sqrt(V a) { return _mm256_sqrt_ps(a); }
  ZT_TARGET_AVX2 static inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  ZT_TARGET_AVX2 static inline V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }

  ZT_TARGET_AVX2 static inline VI iota(uint32_t base) {
    return _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(base)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  ZT_TARGET_AVX2 static inline VI vi_set1(uint32_t x) {
    return _mm256_set1_epi32(static_cast<int>(x));
  }
  ZT_TARGET_AVX2 static inline VI vi_add(VI a, VI b) { return _mm256_add_epi32(a, b); }
  ZT_TARGET_AVX2 static inline VI vi_mul(VI a, VI b) { return _mm256_mullo_epi32(a, b); }
  ZT_TARGET_AVX2 static inline VI vi_xor(VI a, VI b) { return _mm256_xor_si256(a, b); }
  template <int k>
  ZT_TARGET_AVX2 static inline VI vi_srl(VI a) { return _mm256_srli_epi32(a, k); }

 private:
  // Stores bits 16..31 of each lane of `rounded` (NaN lanes of `v` become 0x7FC0).
  ZT_TARGET_AVX2 static inline void store_upper_halves(Bf16* p, __m256i rounded, V v) {
    __m256i hi = _mm256_srli_epi32(rounded, 16);
    const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q));
    hi = _mm256_blendv_epi8(_mm256_set1_epi32(0x7FC0), hi, ordered);
    // Values are in [0, 0xFFFF], so the unsigned-saturating pack is exact.
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
};

// ---------------------------------------------------------------------------------------------
// AVX-512F path
// ---------------------------------------------------------------------------------------------
struct Avx512 {
  using V = __m512;
  using VI = __m512i;
  static constexpr int kWidth = 16;
  static constexpr const char* kName = "avx512";

  ZT_TARGET_AVX512 static inline V set1(float x) { return _mm512_set1_ps(x); }
  ZT_TARGET_AVX512 static inline V load(const float* p) { return _mm512_loadu_ps(p); }
  ZT_TARGET_AVX512 static inline V load(const Bf16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  ZT_TARGET_AVX512 static inline V load(const Fp16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  ZT_TARGET_AVX512 static inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  ZT_TARGET_AVX512 static inline void store(Bf16* p, V v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
    store_upper_halves(p, _mm512_add_epi32(u, bias), v);
  }
  ZT_TARGET_AVX512 static inline void store_sr(Bf16* p, V v, VI r) {
    const __m512i noise = _mm512_and_si512(r, _mm512_set1_epi32(0xFFFF));
    store_upper_halves(p, _mm512_add_epi32(_mm512_castps_si512(v), noise), v);
  }
  ZT_TARGET_AVX512 static inline void store(Fp16* p, V v) {
    const __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }

  ZT_TARGET_AVX512 static inline V add(V a, V b) { return _mm512_add_ps(a, b); }
  ZT_TARGET_AVX512 static inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  ZT_TARGET_AVX512 static inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  ZT_TARGET_AVX512 static inline V div(V a, V b) { return _mm512_div_ps(a, b); }
  ZT_TARGET_AVX512 static inline V sqrt(V a) { return _mm512_sqrt_ps(a); }
  ZT_TARGET_AVX512 static inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  ZT_TARGET_AVX512 static inline V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }

  ZT_TARGET_AVX512 static inline VI iota(uint32_t base) {
    return _mm512_add_epi32(
        _mm512_set1_epi32(static_cast<int>(base)),
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  ZT_TARGET_AVX512 static inline VI vi_set1(uint32_t x) {
    return _mm512_set1_epi32(static_cast<int>(x));
  }
  ZT_TARGET_AVX512 static inline VI vi_add(VI a, VI b) { return _mm512_add_epi32(a, b); }
  ZT_TARGET_AVX512 static inline VI vi_mul(VI a, VI b) { return _mm512_mullo_epi32(a, b); }
  ZT_TARGET_AVX512 static inline VI vi_xor(VI a, VI b) { return _mm512_xor_si512(a, b); }
  template <int k>
  ZT_TARGET_AVX512 static inline VI vi_srl(VI a) { return _mm512_srli_epi32(a, k); }

 private:
  ZT_TARGET_AVX512 static inline void store_upper_halves(Bf16* p, __m512i rounded, V v) {
    __m512i hi = _mm512_srli_epi32(rounded, 16);
    const __mmask16 ordered = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
    hi = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0x7FC0), hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(hi));
  }
};

#endif  // ZT_SIMD_X86

// A counter-based 32-bit hash (the "lowbias32" integer mix) of lane indices; gives the same bits
// for element i whatever the ISA, the thread count or the chunking. Python's reference
// (zerotrain/ops/reference.py, `_hash_u32`) computes the identical function.
template <class S>
inline typename S::VI hash_u32(uint32_t first_index, uint32_t key) {
  using VI = typename S::VI;
  VI x = S::vi_mul(S::iota(first_index), S::vi_set1(0x9E3779B1u));
  x = S::vi_xor(x, S::vi_set1(key));
  x = S::vi_xor(x, S::template vi_srl<16>(x));
  x = S::vi_mul(x, S::vi_set1(0x7FEB352Du));
  x = S::vi_xor(x, S::template vi_srl<15>(x));
  x = S::vi_mul(x, S::vi_set1(0x846CA68Bu));
  x = S::vi_xor(x, S::template vi_srl<16>(x));
  return x;
}

}  // namespace simd
}  // namespace zerotrain

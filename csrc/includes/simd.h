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

// Lane indices, loaded by iota (the first kWidth of them).
alignas(64) inline constexpr int32_t kLaneIndex[16] = {0, 1, 2,  3,  4,  5,  6,  7,
                                                       8, 9, 10, 11, 12, 13, 14, 15};

// The members whose AVX2 and AVX-512 forms differ only in names, written once and stamped into
// each struct: its kName NAME, target attribute T and vector types FV (fp32) and IV (integer); the
// intrinsics' prefix P (_mm256 | _mm512) and integer-vector suffix SI (si256 | si512); 16-bit loads
// and stores use half-width vectors, named by HP (_mm | _mm256), HSI (si128 | si256) and the type
// HI (__m128i | __m256i). Each struct adds what really differs: store_bf16_bits (the NaN blend
// and the 32 -> 16-bit pack).
#define ZT_SIMD_VECTOR_MEMBERS(NAME, T, FV, IV, P, SI, HP, HSI, HI)                                \
  using V = FV;                                                                                    \
  using VI = IV;                                                                                   \
  static constexpr int kWidth = static_cast<int>(sizeof(V) / sizeof(float));                       \
  static constexpr const char* kName = NAME;                                                       \
  T static inline V set1(float x) { return P##_set1_ps(x); }                                       \
  T static inline V load(const float* p) { return P##_loadu_ps(p); }                               \
  T static inline V load(const Bf16* p) {                                                          \
    const HI h = HP##_loadu_##HSI(reinterpret_cast<const HI*>(p));                                 \
    return P##_cast##SI##_ps(P##_slli_epi32(P##_cvtepu16_epi32(h), 16));                           \
  }                                                                                                \
  T static inline V load(const Fp16* p) {                                                          \
    return P##_cvtph_ps(HP##_loadu_##HSI(reinterpret_cast<const HI*>(p)));                         \
  }                                                                                                \
  T static inline void store(float* p, V v) { P##_storeu_ps(p, v); }                               \
  T static inline void store(Bf16* p, V v) {                                                       \
    const VI u = P##_castps_##SI(v);                                                               \
    const VI lsb = P##_and_##SI(P##_srli_epi32(u, 16), P##_set1_epi32(1));                         \
    const VI bias = P##_add_epi32(lsb, P##_set1_epi32(0x7FFF));                                    \
    store_bf16_bits(p, P##_srli_epi32(P##_add_epi32(u, bias), 16), v);                             \
  }                                                                                                \
  T static inline void store_sr(Bf16* p, V v, VI r) {                                              \
    const VI noise = P##_and_##SI(r, P##_set1_epi32(0xFFFF));                                      \
    store_bf16_bits(p, P##_srli_epi32(P##_add_epi32(P##_castps_##SI(v), noise), 16), v);           \
  }                                                                                                \
  T static inline void store(Fp16* p, V v) {                                                       \
    const HI h = P##_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                   \
    HP##_storeu_##HSI(reinterpret_cast<HI*>(p), h);                                                \
  }                                                                                                \
                                                                                                   \
  T static inline V add(V a, V b) { return P##_add_ps(a, b); }                                     \
  T static inline V sub(V a, V b) { return P##_sub_ps(a, b); }                                     \
  T static inline V mul(V a, V b) { return P##_mul_ps(a, b); }                                     \
  T static inline V div(V a, V b) { return P##_div_ps(a, b); }                                     \
  T static inline V sqrt(V a) { return P##_sqrt_ps(a); }                                           \
  T static inline V fmadd(V a, V b, V c) { return P##_fmadd_ps(a, b, c); }                         \
  T static inline V fnmadd(V a, V b, V c) { return P##_fnmadd_ps(a, b, c); }                       \
                                                                                                   \
  T static inline VI iota(uint32_t base) {                                                         \
    const VI lanes = P##_loadu_##SI(reinterpret_cast<const VI*>(kLaneIndex));                      \
    return P##_add_epi32(P##_set1_epi32(static_cast<int>(base)), lanes);                           \
  }                                                                                                \
  T static inline VI vi_set1(uint32_t x) { return P##_set1_epi32(static_cast<int>(x)); }           \
  T static inline VI vi_add(VI a, VI b) { return P##_add_epi32(a, b); }                            \
  T static inline VI vi_mul(VI a, VI b) { return P##_mullo_epi32(a, b); }                          \
  T static inline VI vi_xor(VI a, VI b) { return P##_xor_##SI(a, b); }                             \
  template <int k>                                                                                 \
  T static inline VI vi_srl(VI a) {                                                                \
    return P##_srli_epi32(a, k);                                                                   \
  }

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C path
// ---------------------------------------------------------------------------------------------
struct Avx2 {
  ZT_SIMD_VECTOR_MEMBERS("avx2", ZT_TARGET_AVX2, __m256, __m256i, _mm256, si256, _mm, si128,
                         __m128i)

 private:
  // Stores each lane's bf16 bit pattern (`hi`, in [0, 0xFFFF]); NaN lanes of `v` become 0x7FC0.
  ZT_TARGET_AVX2 static inline void store_bf16_bits(Bf16* p, __m256i hi, V v) {
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
  ZT_SIMD_VECTOR_MEMBERS("avx512", ZT_TARGET_AVX512, __m512, __m512i, _mm512, si512, _mm256, si256,
                         __m256i)

 private:
  ZT_TARGET_AVX512 static inline void store_bf16_bits(Bf16* p, __m512i hi, V v) {
    const __mmask16 ordered = _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q);
    const __m512i bits = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0x7FC0), hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
  }
};

#undef ZT_SIMD_VECTOR_MEMBERS

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

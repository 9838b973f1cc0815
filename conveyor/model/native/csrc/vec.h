// Vectors for the kernels: GCC/Clang vector extensions rather than intrinsics, so that the same source builds
// for AVX2, AVX-512 or NEON with -march=native. v8 is 256 bits (8 floats: AVX2's ymm, or pairs of NEON / SSE
// registers on other targets), v16 is 512 bits (AVX-512's zmm). What every kernel shares: unaligned loads and
// stores, reductions across lanes, e^x, and the bfloat16 <-> float32 conversions.

#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace conveyor {

typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));

// Unaligned load and store of a vector of any width (the copy compiles to one vector move).
template <typename V>
inline V loadv(const float* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
template <typename V>
inline void storev(float* p, V v) {
  __builtin_memcpy(p, &v, sizeof v);
}

// bfloat16 is the top half of a float32: widening is a 16-bit shift, narrowing rounds the low half away (to
// nearest, ties to even, as torch's .to(torch.bfloat16) does; a NaN stays a NaN).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// A cache element (float, or bf16 bits) as float32: widening bf16 is the 16-bit shift back; loadc below does
// the same for a whole vector.
inline float cache_float(float x) { return x; }
inline float cache_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

// float32 narrowed to a float of 5 exponent bits (bias 15) and Mantissa bits, as its low 6 + Mantissa bits: to
// nearest, ties to even, overflowing to infinity, exactly as torch's .to() does (c10's algorithm: the denormal
// range rounded by a float addition that leaves the result in the low bits, the normal range by adding the
// rounding bias below the kept mantissa); a NaN becomes `nan`. fp8 e5m2 (Mantissa 2: the top byte of a float16)
// is what vLLM's --kv-cache-dtype fp8 stores on CPU; float16 (10) is llama.cpp's f16 cache.
template <int Mantissa>
inline uint32_t narrow_to_e5(float f, uint32_t nan) {
  constexpr int kDropped = 23 - Mantissa;  // float32 mantissa bits rounded away
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t bits;
  if (u >= (143u << 23)) {  // |f| >= 2^16, infinity or NaN: past every finite value after rounding
    bits = u > (255u << 23) ? nan : 0x1fu << Mantissa;
  } else if (u < (113u << 23)) {  // |f| < 2^-14: the denormals
    const uint32_t denormal_bias = static_cast<uint32_t>(126 + 10 - Mantissa) << 23;
    float biased, shifted;
    __builtin_memcpy(&biased, &u, sizeof biased);
    __builtin_memcpy(&shifted, &denormal_bias, sizeof shifted);
    biased += shifted;
    uint32_t r;
    __builtin_memcpy(&r, &biased, sizeof r);
    bits = r - denormal_bias;
  } else {
    const uint32_t odd = (u >> kDropped) & 1u;
    u += (static_cast<uint32_t>(15 - 127) << 23) + ((1u << (kDropped - 1)) - 1) + odd;
    bits = u >> kDropped;
  }
  return bits | (sign >> (26 - Mantissa));
}

inline uint8_t fp8_e5m2_bits(float f) { return static_cast<uint8_t>(narrow_to_e5<2>(f, 0x7f)); }

// IEEE float16 bits as float32, exactly (denormals, infinities and NaNs included), lane by lane: the float16
// cache's widening where the build has no F16C, and fp8 e5m2's, whose byte is a float16's top byte.
inline float half_bits_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16, exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  uint32_t u;
  if (exponent == 0x1f) {
    u = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent == 0) {  // zero or a denormal: mantissa * 2^-24
    float f = static_cast<float>(mantissa) * 0x1p-24f;
    __builtin_memcpy(&u, &f, sizeof u);
    u |= sign;
  } else {
    u = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

inline float cache_float(uint8_t bits) { return half_bits_float(static_cast<uint16_t>(bits << 8)); }

// float32 narrowed to IEEE float16 bits (a NaN becomes the quiet NaN). kernel_check holds it to the CPU's own
// conversion (F16C) bit for bit.
inline uint16_t half_bits(float f) { return static_cast<uint16_t>(narrow_to_e5<10>(f, 0x7e00)); }

// A float16 KV cache's element (--kv-cache-dtype float16, llama.cpp's default f16 cache, and what auto stores for
// a GGUF file's weights): IEEE half bits, a type of its own so that the overloads below tell it from bf16's
// uint16_t. Written and widened by the CPU's float16 conversion (F16C) where the build has it, else by
// half_bits and half_bits_float, which round alike.
struct Float16Bits {
  uint16_t bits;
};

#if defined(__F16C__)
inline float cache_float(Float16Bits h) { return _cvtsh_ss(h.bits); }
inline Float16Bits float16_bits(float f) {
  return {static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))};
}
#else
inline float cache_float(Float16Bits h) { return half_bits_float(h.bits); }
inline Float16Bits float16_bits(float f) { return {half_bits(f)}; }
#endif

typedef float v4 __attribute__((vector_size(16)));

inline float sum8(v8 v) {
  const v4 half = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (half[0] + half[2]) + (half[1] + half[3]);
}

// A vector folded to 8 lanes (lane i + lane i + 8): reductions of any width end in sum8 / sums8.
inline v8 fold8(v8 v) { return v; }
inline v8 fold8(v16 v) {
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
}

template <typename V>
inline float sumv(V v) {
  return sum8(fold8(v));
}

template <typename V>
constexpr int kLanesOf = sizeof(V) / sizeof(float);

template <typename V>
inline V splatv(float x) {
  return V{} + x;
}

// The int32 vector as wide as V.
template <typename V>
struct IntOf {
  typedef int32_t type __attribute__((vector_size(sizeof(V))));
};

// e^x lane by lane, to about 1 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial,
// 2^n by writing n into the exponent bits. A scalar std::exp per element costs more than the rest of
// attention's softmax together.
template <typename V>
inline V expv(V x) {
  const V lo = splatv<V>(-87.3f), hi = splatv<V>(88.3f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const V shifter = splatv<V>(12582912.f);  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  const V n = (x * 1.44269504f + shifter) - shifter;
  const V r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts, so r keeps its low bits
  V p = splatv<V>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const typename IntOf<V>::type scale = (__builtin_convertvector(n, typename IntOf<V>::type) + 127) << 23;
  V two_n;
  __builtin_memcpy(&two_n, &scale, sizeof two_n);
  return p * two_n;
}

// silu(g) * u lane by lane: SwiGLU's gate.
template <typename V>
inline V silu_mul(V g, V u) {
  return g / (1.f + expv(-g)) * u;
}

// A vector V of the KV cache's elements as float32: float as it is, bf16 widened in registers (the 16 bits
// shifted into the top half of each lane), so that a bf16 cache is read at half the bytes and computed on
// exactly as the float32 values it stands for.
template <typename V>
inline V loadc(const float* p) {
  return loadv<V>(p);
}
template <typename V>
inline V loadc(const uint16_t* p) {
  typedef uint16_t Half __attribute__((vector_size(sizeof(V) / 2)));
  Half half;
  __builtin_memcpy(&half, p, sizeof half);
  const typename IntOf<V>::type bits = __builtin_convertvector(half, typename IntOf<V>::type) << 16;
  V v;
  __builtin_memcpy(&v, &bits, sizeof v);
  return v;
}

#if defined(__F16C__)
// float16 bits widened exactly by the CPU's float16 conversion (F16C), denormals, infinities and NaNs included:
// 8 in a 128-bit register into a 256-bit V, 16 in a 256-bit register into a 512-bit V.
template <typename V>
inline V widen_halves(__m128i halves) {
  const __m256 wide = _mm256_cvtph_ps(halves);
  V v;
  __builtin_memcpy(&v, &wide, sizeof v);
  return v;
}
#if defined(__AVX512F__)
template <typename V>
inline V widen_halves(__m256i halves) {
  const __m512 wide = _mm512_cvtph_ps(halves);
  V v;
  __builtin_memcpy(&v, &wide, sizeof v);
  return v;
}
#endif
#endif

// fp8 e5m2 widened: each byte becomes a float16's top byte, which widen_halves widens exactly; without F16C,
// lane by lane.
template <typename V>
inline V loadc(const uint8_t* p) {
#if defined(__F16C__)
  if constexpr (sizeof(V) == 32) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return widen_halves<V>(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
  }
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return widen_halves<V>(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
  }
#endif
#endif
  V v;
  for (int lane = 0; lane < kLanesOf<V>; ++lane) v[lane] = cache_float(p[lane]);
  return v;
}

// float16 widened by widen_halves, 8 or 16 lanes at a time; without F16C, lane by lane.
template <typename V>
inline V loadc(const Float16Bits* p) {
#if defined(__F16C__)
  if constexpr (sizeof(V) == 32) return widen_halves<V>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) return widen_halves<V>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#endif
#endif
  V v;
  for (int lane = 0; lane < kLanesOf<V>; ++lane) v[lane] = cache_float(p[lane]);
  return v;
}

// Whether any lane of a comparison's mask is set.
template <typename I>
inline bool any_lane(I mask) {
  bool any = false;
  for (size_t lane = 0; lane < sizeof(I) / sizeof(int32_t); ++lane) any |= mask[lane] != 0;
  return any;
}

}  // namespace conveyor

// Vectors for the kernels: GCC/Clang vector extensions rather than intrinsics, so that the same source builds
// for AVX2, AVX-512 or NEON with -march=native. v8 is 256 bits (8 floats: AVX2's ymm, or pairs of NEON / SSE
// registers on other targets), v16 is 512 bits (AVX-512's zmm). What every kernel shares: unaligned loads and
// stores, reductions across lanes, e^x, and the bfloat16 <-> float32 conversions.

#pragma once

#include <cstddef>
#include <cstdint>

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

// Whether any lane of a comparison's mask is set.
template <typename I>
inline bool any_lane(I mask) {
  bool any = false;
  for (size_t lane = 0; lane < sizeof(I) / sizeof(int32_t); ++lane) any |= mask[lane] != 0;
  return any;
}

}  // namespace conveyor

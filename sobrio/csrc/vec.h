// Helpers shared by the C++ operators: storage types to float32, and AVX-512 float32 <-> bf16 vectors
// with PyTorch's rounding (round to nearest even) and exp. Each operator keeps a scalar loop for tails
// and other CPUs.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace sobrio_vec {

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {  // bf16 is the top half of a float32
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }  // a quantized KV cache's rows
inline float to_float(c10::Float8_e4m3fn x) { return static_cast<float>(x); }

}  // namespace sobrio_vec

#if defined(__AVX512F__)
#include <immintrin.h>

namespace sobrio_vec {

// The storage types the vector loops handle (double and half keep the scalar loops).
template <typename T>
constexpr bool kVectorized = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// exp(x) as 2^n * p(r), r in [-ln2/2, ln2/2], p of degree 6 (relative error ~2e-7); inputs below -87.3
// give exp(-87.3), large ones overflow to inf. libm's expf is not vectorized without -ffast-math.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  const __m512 r2 = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r2, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r2, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r2, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r2, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r2, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r2, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// cap * tanh(s / cap), Gemma 2's attention logit softcap: tanh(x) = 1 - 2 / (e^2x + 1), 2x clamped to +-40
// (tanh is +-1 in float32 well before).
inline __m512 softcap512(__m512 s, float cap) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(s, _mm512_set1_ps(2.f / cap)), _mm512_set1_ps(-40.f)),
                                 _mm512_set1_ps(40.f));
  const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(exp512(x), one)));
  return _mm512_mul_ps(t, _mm512_set1_ps(cap));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const int8_t* p) {  // a quantized KV row, before its scale
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// The value PyTorch would hold after storing v in T.
template <typename T>
inline __m512 round16(__m512 v);
template <>
inline __m512 round16<float>(__m512 v) { return v; }

#if defined(__AVX512BF16__)
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
template <>
inline __m512 round16<c10::BFloat16>(__m512 v) {
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
#endif  // __AVX512BF16__

}  // namespace sobrio_vec
#endif

// Shared helpers of the native CPU kernels (cpu_ops.cpp, cpu_decode_attention.cpp): dtype
// conversions with torch's rounding, a vectorizable exp, and the dtype dispatch.
#pragma once

#include <torch/extension.h>

#include <immintrin.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

namespace sgl_kvxfer_cpu {

// ---------------------------------------------------------------- scalar conversions
// bf16 tensors are handled as raw uint16_t bit patterns (c10::BFloat16's struct accessors keep
// GCC from vectorizing the loops); fp32 tensors as float.
inline float to_f32(uint16_t v) {
  return std::bit_cast<float>(static_cast<uint32_t>(v) << 16);
}
inline float to_f32(float v) { return v; }

template <typename S> inline S from_f32(float f);
template <> inline uint16_t from_f32<uint16_t>(float f) {
  // round-to-nearest-even, branch-free (vectorizes); NaN stays NaN (quiet bit set)
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}
template <> inline float from_f32<float>(float f) { return f; }

// the value torch would hold after computing in fp32 and storing in the tensor's dtype
template <typename S> inline float round_to(float f) { return to_f32(from_f32<S>(f)); }

// exp(x) in fp32 within ~2 ulp (Cephes expf polynomial), written so that loops calling it
// vectorize (std::exp does not without -ffast-math). Overflow gives +inf and underflow 0, as
// expf does (silu of a large negative input must round to 0 like torch's, not to a tiny normal).
inline float fast_exp(float x) {
  const float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  // round to nearest by the 1.5 * 2^23 trick (floorf does not vectorize under trapping math)
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * r * r + r + 1.0f) * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x > 88.72f ? INFINITY : (x < -103.0f ? 0.0f : y);
}

template <typename T> inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]);
}

// scalar_t: the storage type (uint16_t for bf16, float for fp32); ptr<scalar_t>(t) its data.
#define DISPATCH_BF16_AND_FLOAT(DT, NAME, ...)                                                \
  [&] {                                                                                       \
    if ((DT) == at::kBFloat16) { using scalar_t = uint16_t; return __VA_ARGS__(); }          \
    if ((DT) == at::kFloat) { using scalar_t = float; return __VA_ARGS__(); }                \
    TORCH_CHECK(false, NAME, ": unsupported dtype ", DT, " (bfloat16 or float32 only)");      \
  }()

template <typename S> inline S* ptr(const at::Tensor& t) { return reinterpret_cast<S*>(t.data_ptr()); }


#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define SGL_KVXFER_AVX512BF16 1
// exp over 16 lanes: fast_exp's polynomial and its overflow / underflow rule (+inf above
// 88.72, 0 below -103), ~2 ulp.
inline __m512 exp16_avx512(__m512 x_in) {
  const __m512 x = _mm512_max_ps(_mm512_min_ps(x_in, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  __m512 e = _mm512_scalef_ps(y, n);  // exact power-of-two scaling; x == 0 gives exactly 1
  e = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x_in, _mm512_set1_ps(88.72f), _CMP_GT_OQ), e,
                           _mm512_set1_ps(INFINITY));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x_in, _mm512_set1_ps(-103.0f), _CMP_NLT_UQ), e);
}

// 16 bf16 -> 16 fp32 (exact), and back with round-to-nearest-even (VCVTNEPS2BF16; it flushes
// fp32 subnormal inputs to zero, which only changes results below ~1e-38).
inline __m512 load16_bf16(const uint16_t* p, __mmask16 m = 0xFFFF) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store16_bf16(uint16_t* p, __m512 v, __mmask16 m = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
inline __m512 round16_bf16(__m512 v) {  // the fp32 value of v rounded to bf16
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v))), 16));
}
#endif

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& table, const at::Tensor& rows, const at::Tensor& lens,
                            double scale);

}  // namespace sgl_kvxfer_cpu

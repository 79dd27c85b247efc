// Native CPU kernels for half-precision (bf16 / fp16) serving on x86 CPUs.
//
// Built on first use by kernels/cpu_ops.py (torch.utils.cpp_extension, -O3 -march=native
// -fopenmp) from this file and cpu_decode_attention.cpp; each op has a torch reference there and a test in test/kernels/test_cpu_ops.py.
//
//   add_rmsnorm(x, residual|None, weight, eps)  -> (out, x + residual)   [T, H]
//   silu_mul(x [T, 2I])                          -> silu(x[:, :I]) * x[:, I:]   [T, I]
//   rope_qk(q [T,Hq,D], k [T,Hkv,D], cos, sin)   -> contiguous rotated (q, k)
//   decode_attention(q [B,Hq,D], k_buf, v_buf [S,Hkv,D], table [R,C], rows [B], lens [B], scale)
//       -> [B, Hq, D], reading each request's keys/values from the pool IN PLACE through its
//          req_to_token row (no gathered copy, no padding to the longest request).
//
// Rounding mirrors the torch ops they replace: every intermediate torch would round to the
// model dtype is rounded here too (round-to-nearest-even), so most outputs are bit-equal and
// the rest differ by one ulp (fp32 reduction order, exp).
// NOTE: all loops index with int64_t: pools of > 2^31 elements are normal.
#include "cpu_common.h"

namespace sgl_kvxfer_cpu {
namespace {

// ---------------------------------------------------------------- RMSNorm (+ residual)
// torch reference (reference.py rmsnorm_torch):
//   s = x + residual                  (rounded to T; returned as the new residual)
//   n = T(float(s) * rsqrt(mean(float(s)^2) + eps))
//   out = T(float(weight) * float(n))
template <typename T>
void add_rmsnorm_impl(const T* x, const T* res, const T* w, T* out, T* res_out, int64_t rows,
                      int64_t H, int64_t sx, int64_t sr, float eps) {
  at::parallel_for(0, rows, 16, [=](int64_t begin, int64_t end) {
    std::vector<float> buf(H), wf(H);
    load_row(w, wf.data(), H);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * sx;
      if (res != nullptr) {
        const T* rr = res + r * sr;
        T* ro = res_out + r * H;
        for (int64_t i = 0; i < H; ++i) {
          T s = from_f32<T>(to_f32(xr[i]) + to_f32(rr[i]));
          ro[i] = s;
          buf[i] = to_f32(s);
        }
      } else {
        load_row(xr, buf.data(), H);
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += buf[i] * buf[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
      T* o = out + r * H;
      for (int64_t i = 0; i < H; ++i) o[i] = from_f32<T>(wf[i] * round_to<T>(buf[i] * inv));
    }
  });
}

std::vector<at::Tensor> add_rmsnorm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                    const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "add_rmsnorm: x must be [T, H] with a contiguous last dim");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "add_rmsnorm: weight must be contiguous [H] of x's dtype");
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor out = at::empty({T, H}, x.options());
  at::Tensor res_out;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 &&
                residual->scalar_type() == x.scalar_type(), "add_rmsnorm: residual must match x");
    res_out = at::empty({T, H}, x.options());
  }
  DISPATCH_BF16_AND_FLOAT(x.scalar_type(), "add_rmsnorm", [&] {
    add_rmsnorm_impl<scalar_t>(ptr<scalar_t>(x),
                               residual.has_value() ? ptr<scalar_t>(*residual) : nullptr,
                               ptr<scalar_t>(weight), ptr<scalar_t>(out),
                               residual.has_value() ? ptr<scalar_t>(res_out) : nullptr, T, H,
                               x.stride(0), residual.has_value() ? residual->stride(0) : 0,
                               static_cast<float>(eps));
  });
  if (residual.has_value()) return {out, res_out};
  return {out};
}

// ---------------------------------------------------------------- SwiGLU
// torch reference: T(float(T(silu(float(gate)))) * float(up))
template <typename T>
void silu_mul_impl(const T* x, T* out, int64_t rows, int64_t I, int64_t sx) {
  at::parallel_for(0, rows, 8, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * sx;
      const T* u = g + I;
      T* o = out + r * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float gf = to_f32(g[i]);
        const float act = round_to<T>(gf / (1.0f + fast_exp(-gf)));
        o[i] = from_f32<T>(act * to_f32(u[i]));
      }
    }
  });
}

#ifdef SGL_KVXFER_AVX512BF16
// bf16 fast path: 16 lanes and exp16_avx512; the same roundings as the generic loop above.
void silu_mul_bf16_avx512(const uint16_t* x, uint16_t* out, int64_t rows, int64_t I, int64_t sx) {
  at::parallel_for(0, rows, 8, [=](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* g = x + r * sx;
      const uint16_t* u = g + I;
      uint16_t* o = out + r * I;
      for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 m = I - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (I - i)) - 1);
        const __m512 gf = load16_bf16(g + i, m);
        const __m512 d = _mm512_add_ps(one, exp16_avx512(_mm512_sub_ps(_mm512_setzero_ps(), gf)));
        // exact IEEE division, as torch divides: an approximate reciprocal moves silu values
        // that sit on a bf16 rounding midpoint (e.g. gate 5.9375) by one ulp, two after * up
        const __m512 act = round16_bf16(_mm512_div_ps(gf, d));
        store16_bf16(o + i, _mm512_mul_ps(act, load16_bf16(u + i, m)), m);
      }
    }
  });
}
#endif

at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_mul: x must be [T, 2I] with a contiguous last dim");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  at::Tensor out = at::empty({T, I}, x.options());
#ifdef SGL_KVXFER_AVX512BF16
  if (x.scalar_type() == at::kBFloat16) {
    silu_mul_bf16_avx512(ptr<uint16_t>(x), ptr<uint16_t>(out), T, I, x.stride(0));
    return out;
  }
#endif
  DISPATCH_BF16_AND_FLOAT(x.scalar_type(), "silu_mul", [&] {
    silu_mul_impl<scalar_t>(ptr<scalar_t>(x), ptr<scalar_t>(out), T, I, x.stride(0));
  });
  return out;
}

// ---------------------------------------------------------------- RoPE on q and k
// torch reference (reference.py apply_rope), per half-pair (x1, x2) = (x[:D/2], x[D/2:]):
//   out1 = T(T(x1 * c) - T(x2 * s));  out2 = T(T(x2 * c) + T(x1 * s))
template <typename T>
void rope_rows(const T* src, int64_t st, int64_t sh, T* dst, int64_t H, int64_t D, const T* cos,
               const T* sin, int64_t sc, int64_t rows) {
  const int64_t half = D / 2;
  at::parallel_for(0, rows, 16, [=](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * sc;
      const T* s = sin + t * sc;
      for (int64_t h = 0; h < H; ++h) {
        const T* x = src + t * st + h * sh;
        T* o = dst + (t * H + h) * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f32(x[i]), x2 = to_f32(x[i + half]);
          const float cf = to_f32(c[i]), sf = to_f32(s[i]);
          o[i] = from_f32<T>(round_to<T>(x1 * cf) - round_to<T>(x2 * sf));
          o[i + half] = from_f32<T>(round_to<T>(x2 * cf) + round_to<T>(x1 * sf));
        }
      }
    }
  });
}

std::vector<at::Tensor> rope_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1,
              "rope_qk: q, k must be [T, H, D] with a contiguous last dim");
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D && D % 2 == 0, "rope_qk: q/k shapes disagree");
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) == T && cos.size(2) == D / 2 && cos.stride(2) == 1 &&
              sin.sizes() == cos.sizes() && sin.strides() == cos.strides(),
              "rope_qk: cos/sin must be [T, 1, D/2] with a contiguous last dim");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type() &&
              sin.scalar_type() == q.scalar_type(), "rope_qk: q, k, cos, sin must share one dtype");
  at::Tensor qo = at::empty({T, q.size(1), D}, q.options());
  at::Tensor ko = at::empty({T, k.size(1), D}, k.options());
  DISPATCH_BF16_AND_FLOAT(q.scalar_type(), "rope_qk", [&] {
    rope_rows<scalar_t>(ptr<scalar_t>(q), q.stride(0), q.stride(1), ptr<scalar_t>(qo),
                        q.size(1), D, ptr<scalar_t>(cos), ptr<scalar_t>(sin), cos.stride(0), T);
    rope_rows<scalar_t>(ptr<scalar_t>(k), k.stride(0), k.stride(1), ptr<scalar_t>(ko),
                        k.size(1), D, ptr<scalar_t>(cos), ptr<scalar_t>(sin), cos.stride(0), T);
  });
  return {qo, ko};
}

// ---------------------------------------------------------------- logits helpers
// Exact bf16 -> fp32 widening, in parallel, into `out` when given (a reused buffer: a fresh
// 50 MB fp32 logits tensor per decode step page-faults for longer than the widening takes).
at::Tensor bf16_to_f32(const at::Tensor& x, const c10::optional<at::Tensor>& out_opt) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "bf16_to_f32: contiguous bf16 input");
  at::Tensor out = out_opt.has_value() ? *out_opt : at::empty(x.sizes(), x.options().dtype(at::kFloat));
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == x.sizes(),
              "bf16_to_f32: out must be contiguous fp32 of x's shape");
  const uint16_t* src = ptr<uint16_t>(x);
  float* dst = ptr<float>(out);
  at::parallel_for(0, x.numel(), 1 << 16, [=](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) dst[i] = to_f32(src[i]);
  });
  return out;
}

// Row-wise argmax of fp32 [R, V] with torch's semantics: the first maximal index, and a NaN
// counts as the maximum (the first NaN's index). Parallel over rows.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) > 0,
              "argmax_rows: contiguous fp32 [R, V] with V > 0");
  const int64_t R = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  const float* src = ptr<float>(x);
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = src + r * V;
      float m = -INFINITY;
      int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
      for (int64_t i = 0; i < V; ++i) {
        m = row[i] > m ? row[i] : m;
        nan |= row[i] != row[i];
      }
      int64_t idx = 0;
      for (int64_t i = 0; i < V; ++i) {
        if (nan ? row[i] != row[i] : row[i] == m) {
          idx = i;
          break;
        }
      }
      dst[r] = idx;
    }
  });
  return out;
}

}  // namespace
}  // namespace sgl_kvxfer_cpu

using namespace sgl_kvxfer_cpu;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rmsnorm", &add_rmsnorm, "RMSNorm with optional fused residual add (CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up (CPU)");
  m.def("rope_qk", &rope_qk, "RoPE on q and k, contiguous outputs (CPU)");
  m.def("bf16_to_f32", &bf16_to_f32, "exact bf16 -> fp32 widening, parallel (CPU)");
  m.def("argmax_rows", &argmax_rows, "first-max argmax of each fp32 row, parallel (CPU)");
  m.def("decode_attention", &sgl_kvxfer_cpu::decode_attention, "GQA decode attention over the KV pool in place (CPU)");
}

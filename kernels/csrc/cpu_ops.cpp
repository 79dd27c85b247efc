// Native CPU kernels for half-precision (bf16 / fp16) serving on x86 CPUs.
//
// Built on first use by kernels/cpu_ops.py (torch.utils.cpp_extension, -O3 -march=native
// -fopenmp); each op has a torch reference there and a test in test/kernels/test_cpu_ops.py.
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
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

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

// ---------------------------------------------------------------- RMSNorm (+ residual)
// torch reference (fused_ops.rmsnorm_torch):
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

at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_mul: x must be [T, 2I] with a contiguous last dim");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  at::Tensor out = at::empty({T, I}, x.options());
  DISPATCH_BF16_AND_FLOAT(x.scalar_type(), "silu_mul", [&] {
    silu_mul_impl<scalar_t>(ptr<scalar_t>(x), ptr<scalar_t>(out), T, I, x.stride(0));
  });
  return out;
}

// ---------------------------------------------------------------- RoPE on q and k
// torch reference (models/rope.py apply_rope), per half-pair (x1, x2) = (x[:D/2], x[D/2:]):
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

// ---------------------------------------------------------------- decode attention
// One work item = (request b, kv head h): its G = Hq / Hkv query heads share every key row.
//   pass 1: scores[g, j] = scale * <q[b, h*G + g], K[slot_j, h]>    j < seq_len[b]
//   softmax over j in fp32, pass 2: out[b, h*G + g] = sum_j p[g, j] * V[slot_j, h]
// slot_j = table[rows[b], j]. Keys and values are read once per work item, from the pool.
// Rows are handled as 8-float GCC vectors (D % 8 == 0; the launcher checks).
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline v8f load8(const uint16_t* p) {  // 8 bf16 -> 8 fp32
  v8u16 raw;
  __builtin_memcpy(&raw, p, sizeof(raw));
  return reinterpret_cast<v8f>(__builtin_convertvector(raw, v8u32) << 16);
}
inline float hsum8(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

template <typename T, typename I>
void decode_attention_impl(const T* q, const T* kb, const T* vb, const I* table, int64_t table_stride,
                           const int64_t* rows, const int64_t* lens, T* out, int64_t B, int64_t Hq,
                           int64_t Hkv, int64_t D, float scale) {
  const int64_t G = Hq / Hkv, C = D / 8;  // C chunks of 8 per row
  const int64_t row_elems = Hkv * D;       // one slot's K (or V) row across heads
  at::parallel_for(0, B * Hkv, 1, [=](int64_t begin, int64_t end) {
    constexpr int64_t KB = 4;
    std::vector<v8f> qv(G * C), acc(G * C), kf(KB * C);
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t L = lens[b];
      const I* slots = table + rows[b] * table_stride;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < C; ++c) qv[g * C + c] = load8(q + (b * Hq + h * G + g) * D + 8 * c) * scale;
      scores.resize(G * L);
      // QK in blocks of KB keys: convert the block to fp32 once, then KB independent FMA
      // chains per query head (one chain per dot would stall on FMA latency).
      for (int64_t j0 = 0; j0 < L; j0 += KB) {
        const int64_t n = std::min<int64_t>(KB, L - j0);
        for (int64_t jj = 0; jj < n; ++jj) {
          const T* kr = kb + static_cast<int64_t>(slots[j0 + jj]) * row_elems + h * D;
          for (int64_t c = 0; c < C; ++c) kf[jj * C + c] = load8(kr + 8 * c);
        }
        for (int64_t jj = n; jj < KB; ++jj)
          for (int64_t c = 0; c < C; ++c) kf[jj * C + c] = v8f{};
        for (int64_t g = 0; g < G; ++g) {
          v8f d0 = {}, d1 = {}, d2 = {}, d3 = {};
          const v8f* qg = qv.data() + g * C;
          for (int64_t c = 0; c < C; ++c) {
            d0 += qg[c] * kf[0 * C + c];
            d1 += qg[c] * kf[1 * C + c];
            d2 += qg[c] * kf[2 * C + c];
            d3 += qg[c] * kf[3 * C + c];
          }
          const float dots[KB] = {hsum8(d0), hsum8(d1), hsum8(d2), hsum8(d3)};
          for (int64_t jj = 0; jj < n; ++jj) scores[g * L + j0 + jj] = dots[jj];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < L; ++j) m = sg[j] > m ? sg[j] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < L; ++j) {
          sg[j] = fast_exp(sg[j] - m);
          sum += sg[j];
        }
        const float inv = L > 0 ? 1.0f / sum : 0.f;
#pragma omp simd
        for (int64_t j = 0; j < L; ++j) sg[j] *= inv;
      }
      for (auto& a : acc) a = v8f{};
      for (int64_t j = 0; j < L; ++j) {
        const T* vr = vb + static_cast<int64_t>(slots[j]) * row_elems + h * D;
        for (int64_t c = 0; c < C; ++c) {
          const v8f vc = load8(vr + 8 * c);
          for (int64_t g = 0; g < G; ++g) acc[g * C + c] += scores[g * L + j] * vc;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* o = out + (b * Hq + h * G + g) * D;
        for (int64_t c = 0; c < C; ++c)
          for (int64_t e = 0; e < 8; ++e) o[8 * c + e] = from_f32<T>(acc[g * C + c][e]);
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& table, const at::Tensor& rows, const at::Tensor& lens,
                            double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "decode_attention: q must be contiguous [B, Hq, D]");
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.is_contiguous() && v_buf.sizes() == k_buf.sizes() && v_buf.is_contiguous(),
              "decode_attention: k_buf, v_buf must be contiguous [S, Hkv, D] of one shape");
  TORCH_CHECK(k_buf.scalar_type() == q.scalar_type() && v_buf.scalar_type() == q.scalar_type(),
              "decode_attention: q and the pool must share one dtype");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_buf.size(1);
  TORCH_CHECK(k_buf.size(2) == D && Hkv > 0 && Hq % Hkv == 0, "decode_attention: head shapes disagree");
  TORCH_CHECK(D % 8 == 0, "decode_attention: head_dim must be a multiple of 8, got ", D);
  TORCH_CHECK(table.dim() == 2 && table.stride(1) == 1, "decode_attention: table must be [R, C], rows contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && rows.is_contiguous() &&
              lens.is_contiguous() && rows.numel() == B && lens.numel() == B,
              "decode_attention: rows, lens must be contiguous int64 [B]");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(rp[b] >= 0 && rp[b] < table.size(0) && lp[b] >= 0 && lp[b] <= table.size(1),
                "decode_attention: request row or length out of the table's range");
  // NOTE: slots inside the rows are trusted (the allocator hands out 0..S-1 only); checking
  // each one per layer would cost a pass over every row.
  at::Tensor out = at::empty_like(q);
  DISPATCH_BF16_AND_FLOAT(q.scalar_type(), "decode_attention", [&] {
    if (table.scalar_type() == at::kLong) {
      decode_attention_impl<scalar_t, int64_t>(
          ptr<scalar_t>(q), ptr<scalar_t>(k_buf), ptr<scalar_t>(v_buf),
          table.data_ptr<int64_t>(), table.stride(0), rp, lp, ptr<scalar_t>(out), B, Hq, Hkv, D,
          static_cast<float>(scale));
    } else {
      TORCH_CHECK(table.scalar_type() == at::kInt, "decode_attention: table must be int32 or int64");
      decode_attention_impl<scalar_t, int32_t>(
          ptr<scalar_t>(q), ptr<scalar_t>(k_buf), ptr<scalar_t>(v_buf),
          table.data_ptr<int32_t>(), table.stride(0), rp, lp, ptr<scalar_t>(out), B, Hq, Hkv, D,
          static_cast<float>(scale));
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rmsnorm", &add_rmsnorm, "RMSNorm with optional fused residual add (CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up (CPU)");
  m.def("rope_qk", &rope_qk, "RoPE on q and k, contiguous outputs (CPU)");
  m.def("decode_attention", &decode_attention, "GQA decode attention over the KV pool in place (CPU)");
}

// GQA decode attention over the KV pool in place (see kernels/cpu_ops.py). Part of the native
// CPU extension built by kernels/cpu_ops.py; shared helpers in cpu_common.h.
#include "cpu_common.h"

#include <immintrin.h>

#include <type_traits>

namespace sgl_kvxfer_cpu {
namespace {

// ---------------------------------------------------------------- decode attention
// One work item = (request b, kv head h): its G = Hq / Hkv query heads share every key row.
//   pass 1: scores[g, j] = scale * <q[b, h*G + g], K[slot_j, h]>    j < seq_len[b]
//   softmax over j in fp32, pass 2: out[b, h*G + g] = sum_j p[g, j] * V[slot_j, h]
// slot_j = table[rows[b], j]. Keys and values are read once per work item, from the pool.
//
// Two implementations:
//  * decode_attention_generic: any dtype, D % 8 == 0, rows as 8-float GCC vectors.
//  * decode_attention_bf16_avx512 (bf16 only, AVX512_BF16 builds, D % 32 == 0, G <= 8):
//    QK with vdpbf16ps on the raw bf16 q/K rows (products of two bf16 are exact in fp32, sums
//    in fp32; scale applied to the fp32 dot), 16 keys reduced at once by a shuffle tree;
//    softmax in fp32; PV in fp32 FMAs (p never rounded), V rows widened without shuffles as
//    even/odd element halves, accumulators in registers (G and the per-pass chunk count are
//    template parameters). Normalisation by 1/sum is applied to the accumulated output.
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
void decode_attention_generic(const T* q, const T* kb, const T* vb, const I* table, int64_t table_stride,
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define DECODE_ATTN_AVX512BF16 1

// Two vectors of 16 partial sums each -> one vector whose lanes are pairwise partial sums,
// keeping per-input order: lane layout after all four levels = input index (see dec_reduce16).
inline __m512 dec_red_ps(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}
inline __m512 dec_red_lanes(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
// lane t of the result = horizontal sum of v[t]
inline __m512 dec_reduce16(const __m512* v) {
  __m512 l1[8], l2[4];
  for (int i = 0; i < 8; ++i) l1[i] = dec_red_ps(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) l2[i] = dec_red_ps(l1[2 * i], l1[2 * i + 1]);
  return dec_red_lanes(dec_red_lanes(l2[0], l2[1]), dec_red_lanes(l2[2], l2[3]));
}

// from_f32<uint16_t> on 16 lanes (same RNE and NaN rule), result in the low 16 bits of each lane
inline __m512i dec_round_bf16(__m512 f) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)),
                       _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1))), 16);
  const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                   _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_mov_epi32(rounded, is_nan, nan);
}

// PV for output columns [d0, d0 + 32 * DC) of G heads. p: [G][Lp] unnormalised weights,
// inv[g] = 1 / sum_j p[g, j]. Each 32-bf16 V chunk is widened as its even elements (<< 16) and
// odd elements (& 0xffff0000), so acc_e/acc_o hold the even/odd output columns.
template <int G, int DC>
inline void dec_pv_pass(const uint16_t* vb, const int64_t* offs, int64_t L, const float* p, int64_t Lp,
                        const float* inv, uint16_t* o0, int64_t D, int64_t d0) {
  __m512 acc_e[G][DC], acc_o[G][DC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) acc_e[g][c] = acc_o[g][c] = _mm512_setzero_ps();
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  constexpr int64_t PF = 8;  // rows ahead to prefetch into L1
  for (int64_t j = 0; j < L; ++j) {
    if (j + PF < L) {
      const char* pf = reinterpret_cast<const char*>(vb + offs[j + PF] + d0);
      for (int c = 0; c < DC; ++c) _mm_prefetch(pf + 64 * c, _MM_HINT_T0);
    }
    const uint16_t* vr = vb + offs[j] + d0;
    __m512 ve[DC], vo[DC];
    for (int c = 0; c < DC; ++c) {
      const __m512i x = _mm512_loadu_si512(vr + 32 * c);
      ve[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      vo[c] = _mm512_castsi512_ps(_mm512_and_si512(x, hi_mask));
    }
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * Lp + j]);
      for (int c = 0; c < DC; ++c) {
        acc_e[g][c] = _mm512_fmadd_ps(pg, ve[c], acc_e[g][c]);
        acc_o[g][c] = _mm512_fmadd_ps(pg, vo[c], acc_o[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 s = _mm512_set1_ps(inv[g]);
    uint16_t* o = o0 + g * D + d0;
    for (int c = 0; c < DC; ++c) {
      const __m512i e = dec_round_bf16(_mm512_mul_ps(acc_e[g][c], s));
      const __m512i od = dec_round_bf16(_mm512_mul_ps(acc_o[g][c], s));
      _mm512_storeu_si512(o + 32 * c, _mm512_or_si512(e, _mm512_slli_epi32(od, 16)));
    }
  }
}

template <int G, int DC>
inline void dec_pv(const uint16_t* vb, const int64_t* offs, int64_t L, const float* p, int64_t Lp,
                   const float* inv, uint16_t* o0, int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += 32 * DC) dec_pv_pass<G, DC>(vb, offs, L, p, Lp, inv, o0, D, d0);
}

// Requires: bf16 data, D == 32 * DK, 1 <= G <= 8; slots trusted to lie in [0, S).
// Exactly one of table64 / table32 is non-null.
template <int G, int DK>
void decode_attention_bf16_avx512(const uint16_t* q, const uint16_t* kb, const uint16_t* vb,
                                  const int64_t* table64, const int32_t* table32, int64_t table_stride,
                                  const int64_t* rows, const int64_t* lens, uint16_t* out, int64_t B, int64_t Hq,
                                  int64_t Hkv, float scale) {
  constexpr int64_t D = 32 * DK;
  const int64_t row_elems = Hkv * D;
  // PV chunks per pass: accumulators (2 * G * DC zmm) must stay in registers
  constexpr int DCr = 2 * G * 4 <= 16 ? 4 : (2 * G * 2 <= 16 ? 2 : 1);
  constexpr int DC = DK % DCr == 0 ? DCr : (DK % 2 == 0 && DCr >= 2 ? 2 : 1);
  constexpr int64_t kPfBlocks = 2;  // prefetch distance in 16-key blocks (1..4 measured alike)
  at::parallel_for(0, B * Hkv, 1, [=](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> offs;
    int64_t offs_b = -1;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t L = lens[b];
      uint16_t* o0 = out + (b * Hq + h * G) * D;
      if (L == 0) {
        std::fill(o0, o0 + G * D, uint16_t{0});
        continue;
      }
      const int64_t Lp = (L + 15) & ~int64_t{15};
      // element offsets of each key's row in the pool (head 0), shared by the Hkv items of b
      if (offs_b != b) {
        offs.resize(Lp);
        if (table64 != nullptr) {
          const int64_t* slots = table64 + rows[b] * table_stride;
          for (int64_t j = 0; j < L; ++j) offs[j] = slots[j] * row_elems;
        } else {
          const int32_t* slots = table32 + rows[b] * table_stride;
          for (int64_t j = 0; j < L; ++j) offs[j] = static_cast<int64_t>(slots[j]) * row_elems;
        }
        // padding keys (j >= L) point at key 0: valid memory, their scores are masked below
        for (int64_t j = L; j < Lp; ++j) offs[j] = offs[0];
        offs_b = b;
      }
      const uint16_t* kh = kb + h * D;
      const uint16_t* vh = vb + h * D;
      const uint16_t* qh = q + (b * Hq + h * G) * D;
      scores.resize(G * Lp);
      float* sc = scores.data();
      const __m512 vscale = _mm512_set1_ps(scale);
      // ---- QK, 16 keys per block
      // K rows of the first blocks; later blocks are requested kPfBlocks blocks ahead (K into L1,
      // V into L2 for the PV pass) to keep enough misses in flight for scattered slots
      for (int64_t j = 0; j < std::min<int64_t>(Lp, 16 * kPfBlocks); ++j)
        for (int c = 0; c < 2 * DK; ++c) _mm_prefetch(reinterpret_cast<const char*>(kh + offs[j]) + 64 * c, _MM_HINT_T0);
      for (int64_t j0 = 0; j0 < Lp; j0 += 16) {
        const int64_t jp = j0 + 16 * kPfBlocks;
        if (jp < Lp) {
          for (int t = 0; t < 16; ++t) {
            const char* kp = reinterpret_cast<const char*>(kh + offs[jp + t]);
            const char* vp = reinterpret_cast<const char*>(vh + offs[jp - 16 * kPfBlocks + t]);
            for (int c = 0; c < 2 * DK; ++c) {
              _mm_prefetch(kp + 64 * c, _MM_HINT_T0);
              _mm_prefetch(vp + 64 * c, _MM_HINT_T1);
            }
          }
        } else {
          for (int t = 0; t < 16; ++t) {
            const char* vp = reinterpret_cast<const char*>(vh + offs[j0 + t]);
            for (int c = 0; c < 2 * DK; ++c) _mm_prefetch(vp + 64 * c, _MM_HINT_T1);
          }
        }
        const uint16_t* kr[16];
        for (int t = 0; t < 16; ++t) kr[t] = kh + offs[j0 + t];
        for (int g = 0; g < G; ++g) {
          const uint16_t* qg = qh + g * D;
          __m512 part[16];
          for (int t = 0; t < 16; ++t) {
            __m512 a = _mm512_setzero_ps();
            for (int c = 0; c < DK; ++c)
              a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qg + 32 * c),
                                   (__m512bh)_mm512_loadu_si512(kr[t] + 32 * c));
            part[t] = a;
          }
          _mm512_storeu_ps(sc + g * Lp + j0, _mm512_mul_ps(dec_reduce16(part), vscale));
        }
      }
      // ---- softmax (unnormalised weights; 1/sum folded into the output)
      float inv[G];
      const int64_t tail = L - (Lp - 16);  // valid lanes in the last block, 1..16
      const __mmask16 last_mask = static_cast<__mmask16>((1u << tail) - 1u);
      for (int g = 0; g < G; ++g) {
        float* sg = sc + g * Lp;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j + 16 < Lp; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + j));
        mx = _mm512_mask_max_ps(mx, last_mask, mx, _mm512_loadu_ps(sg + Lp - 16));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < Lp; j += 16) {
          __m512 e = exp16_avx512(_mm512_sub_ps(_mm512_loadu_ps(sg + j), m));
          if (j + 16 == Lp) e = _mm512_maskz_mov_ps(last_mask, e);  // padding weights are exactly 0
          _mm512_storeu_ps(sg + j, e);
          sum = _mm512_add_ps(sum, e);
        }
        inv[g] = 1.0f / _mm512_reduce_add_ps(sum);  // sum >= 1 (the max's weight is exactly 1)
      }
      // ---- PV
      dec_pv<G, DC>(vh, offs.data(), L, sc, Lp, inv, o0, D);
    }
  });
}

// true when the AVX-512 path took the call
template <typename I>
bool decode_attention_fast(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, const I* table,
                           int64_t table_stride, const int64_t* rp, const int64_t* lp, at::Tensor& out,
                           int64_t B, int64_t Hq, int64_t Hkv, int64_t D, float scale) {
  if (q.scalar_type() != at::kBFloat16 || D % 32 != 0 || D > 128) return false;
  const int64_t G = Hq / Hkv;
  const int64_t* t64 = nullptr;
  const int32_t* t32 = nullptr;
  if constexpr (std::is_same_v<I, int64_t>) t64 = table; else t32 = table;
  auto run = [&](auto g_const) {
    constexpr int GV = decltype(g_const)::value;
    auto* fn = &decode_attention_bf16_avx512<GV, 2>;
    if (D == 32) fn = &decode_attention_bf16_avx512<GV, 1>;
    else if (D == 96) fn = &decode_attention_bf16_avx512<GV, 3>;
    else if (D == 128) fn = &decode_attention_bf16_avx512<GV, 4>;
    fn(ptr<uint16_t>(q), ptr<uint16_t>(k_buf), ptr<uint16_t>(v_buf), t64, t32, table_stride, rp, lp,
       ptr<uint16_t>(out), B, Hq, Hkv, scale);
    return true;
  };
  switch (G) {
    case 1: return run(std::integral_constant<int, 1>{});
    case 2: return run(std::integral_constant<int, 2>{});
    case 3: return run(std::integral_constant<int, 3>{});
    case 4: return run(std::integral_constant<int, 4>{});
    case 5: return run(std::integral_constant<int, 5>{});
    case 6: return run(std::integral_constant<int, 6>{});
    case 7: return run(std::integral_constant<int, 7>{});
    case 8: return run(std::integral_constant<int, 8>{});
    default: return false;
  }
}
#else
template <typename I>
bool decode_attention_fast(const at::Tensor&, const at::Tensor&, const at::Tensor&, const I*, int64_t,
                           const int64_t*, const int64_t*, at::Tensor&, int64_t, int64_t, int64_t, int64_t,
                           float) {
  return false;
}
#endif

template <typename I>
void decode_attention_dispatch(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                               const I* table, int64_t table_stride, const int64_t* rp, const int64_t* lp,
                               at::Tensor& out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, float scale) {
  if (decode_attention_fast<I>(q, k_buf, v_buf, table, table_stride, rp, lp, out, B, Hq, Hkv, D, scale)) return;
  DISPATCH_BF16_AND_FLOAT(q.scalar_type(), "decode_attention", [&] {
    decode_attention_generic<scalar_t, I>(ptr<scalar_t>(q), ptr<scalar_t>(k_buf), ptr<scalar_t>(v_buf), table,
                                          table_stride, rp, lp, ptr<scalar_t>(out), B, Hq, Hkv, D, scale);
  });
}

}  // namespace

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
  const float fscale = static_cast<float>(scale);
  if (table.scalar_type() == at::kLong) {
    decode_attention_dispatch<int64_t>(q, k_buf, v_buf, table.data_ptr<int64_t>(), table.stride(0), rp, lp, out,
                                       B, Hq, Hkv, D, fscale);
  } else {
    TORCH_CHECK(table.scalar_type() == at::kInt, "decode_attention: table must be int32 or int64");
    decode_attention_dispatch<int32_t>(q, k_buf, v_buf, table.data_ptr<int32_t>(), table.stride(0), rp, lp, out,
                                       B, Hq, Hkv, D, fscale);
  }
  return out;
}

}  // namespace sgl_kvxfer_cpu

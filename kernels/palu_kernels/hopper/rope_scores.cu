// RoPE scores over M-LRD latents (rank 64 per KV head, head_dim 128), warp-specialised for Hopper.
//
// score(t) = sum_f cos((p0+t) th_f) (a_f . h_t) + sin((p0+t) th_f) (c_f . h_t), with the query folded
// into B_k once per step (a_f = q1_f B1_f + q2_f B2_f, c_f = q2_f B1_f - q1_f B2_f; the same algebra as
// the Triton kernel `_scores_qproj`, which stays the CPU-tested reference and the fallback).
//
// One CTA per (sequence, KV head, split of the tokens):
//   warp 0      producer: TMA bulk copies (cp.async.bulk, one 128-byte row per token) of 64-token latent
//               tiles into a ring of STAGES shared-memory slots, signalled by mbarriers (complete_tx);
//   warps 1..   consumers, two per query head of the KV head (NQ query heads: 1 for MHA, n_rep for GQA):
//               each holds 32 frequencies of its head's folded query in registers as mma A fragments
//               (64 registers), reads a slot's 64 tokens as B fragments (ldmatrix; rows padded to 144
//               bytes so the eight rows of a matrix fall on distinct banks), mma.sync m16n8k16 into
//               fp32, weights the products by cos/sin (per-thread phasors advanced by a rotation each
//               8 tokens: no trig in the loop), reduces over its frequencies (a butterfly over the
//               eight lanes that share tokens), and releases the slot as soon as its fragments are in
//               registers, so the producer refills it while the epilogue runs. The two warps of a head
//               add their halves through shared memory (named barrier, double-buffered).
// The loads, the tensor-core products and the cos/sin epilogue of different warps and CTAs overlap:
// that is what the Triton kernel (one program does all three in sequence) could not express.
#ifndef PALU_KERNEL_ONLY   // defined: the device code alone (a register / SASS check without torch)
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

constexpr int R = 64;            // latent rank per KV head
constexpr int HALF = 64;         // head_dim / 2: frequencies
constexpr int TILE = 64;         // tokens per slot
constexpr int ROW = R * 2;       // shared-memory row of one token (bytes), unpadded: a slot is one copy
constexpr int SLOT_BYTES = TILE * ROW;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void mma16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Barrier ids are immediates: with a register id ptxas reserves all 16 of the SM's barriers per CTA,
// which held the MHA kernel to 2 CTAs per SM (measured, benchmarks/NOTES.md h1).
template <int ID, int THREADS>
__device__ __forceinline__ void bar_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(ID), "n"(THREADS) : "memory");
}
template <int NQ, int THREADS>
__device__ __forceinline__ void head_sync(int qi) {
  static_assert(NQ == 1 || NQ == 4, "barrier ids are written out for 1 or 4 query heads per KV head");
  if (NQ == 1) {
    bar_sync<1, THREADS>();
    return;
  }
  switch (qi) {
    case 0: bar_sync<1, THREADS>(); break;
    case 1: bar_sync<2, THREADS>(); break;
    case 2: bar_sync<3, THREADS>(); break;
    default: bar_sync<4, THREADS>(); break;
  }
}

template <int FPW>
__host__ __device__ constexpr int part_floats(int nq) { return nq * 2 * (HALF / FPW - 1) * TILE; }
template <int FPW>
__host__ __device__ constexpr int tiles_offset(int nq) { return ((256 + part_floats<FPW>(nq) * 4 + 127) / 128) * 128; }

// Keep the half of `v` whose index bit `bit` matches this lane's `up`, adding the partner's half.
template <int N>
__device__ __forceinline__ void fold_half(const float* v, float* w, bool up, int lane_mask) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float send = up ? v[k] : v[k + N];
    float keep = up ? v[k + N] : v[k];
    w[k] = keep + __shfl_xor_sync(0xffffffffu, send, lane_mask);
  }
}

// MHA with 16 frequencies per warp: 4 CTAs per SM need <= 102 registers (h3 compiled to 104: 3 CTAs)
// RED: 0 — the warps of a head add their partial sums through shared memory (named barrier per slot);
//      1 — each warp adds its partial sums into the zeroed scores with red.global.add (no barrier)
template <int NQ, int FPW, int STAGES, int RED>
__global__ void __launch_bounds__(32 * (1 + HALF / FPW * NQ), (NQ == 1 && FPW == 16) ? 4 : 1)
    rope_scores_kernel(const __half* __restrict__ hk, const __half* __restrict__ fold,
                       const int* __restrict__ pos0, const float* __restrict__ inv_freq,
                       float* __restrict__ S, const int* __restrict__ lengths, int G, int H,
                       int tokens_per_split, float qk_scale, long long s_kb, long long s_kg, long long s_kt,
                       long long s_sb, long long s_sh) {
  constexpr int FP = HALF / FPW;   // consumer warps per query head
  constexpr int MT = FPW / 8;      // m-tiles per warp: [0, MT/2) rows a_f, [MT/2, MT) rows c_f
  constexpr int JT = FPW / 8;      // frequencies per thread
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + STAGES;
  float* part = reinterpret_cast<float*>(smem + 256);   // [NQ][2][FP - 1][TILE] partial sums
  unsigned char* tiles = smem + tiles_offset<FPW>(NQ);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int b = blockIdx.x / G, g = blockIdx.x % G;
  const int t0 = blockIdx.y * tokens_per_split;
  const int t_end = min(t0 + tokens_per_split, lengths[b]);
  const int n_tiles = t_end > t0 ? (t_end - t0 + TILE - 1) / TILE : 0;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], FP * NQ);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == 0) {  // producer
    const __half* src = hk + b * s_kb + g * s_kg;
    for (int i = 0; i < n_tiles; ++i) {
      const int slot = i % STAGES;
      mbar_wait(&empty[slot], ((i / STAGES) & 1) ^ 1);
      const int t = t0 + i * TILE;
      const int rows = min(TILE, t_end - t);
      if (lane == 0) mbar_expect_tx(&full[slot], rows * R * 2);
      __syncwarp();
      unsigned char* dst = tiles + slot * SLOT_BYTES;
      if (s_kt == R) {   // the tile is contiguous: one copy (per-row copies of 128 bytes capped h1/h2)
        if (lane == 0) bulk_copy(dst, src + t * s_kt, rows * R * 2, &full[slot]);
      } else {
        for (int r = lane; r < rows; r += 32) bulk_copy(dst + r * ROW, src + (t + r) * s_kt, R * 2, &full[slot]);
      }
    }
    return;
  }

  const int cw = warp - 1, qi = cw / FP, fp = cw % FP;
  const int u = g * NQ + qi;  // query head
  const int gq = lane >> 2, cq = lane & 3;

  // A fragments: rows [0, FPW) are a_f, rows [FPW, 2 FPW) c_f for f = fp * FPW + row % FPW
  uint32_t a[MT][4][4];
  const __half* W = fold + ((static_cast<long long>(b) * H + u) * FP + fp) * (2 * FPW * R);
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const __half* p = W + (16 * m + gq) * R + 16 * ks + 2 * cq;
      a[m][ks][0] = *reinterpret_cast<const uint32_t*>(p);
      a[m][ks][1] = *reinterpret_cast<const uint32_t*>(p + 8 * R);
      a[m][ks][2] = *reinterpret_cast<const uint32_t*>(p + 8);
      a[m][ks][3] = *reinterpret_cast<const uint32_t*>(p + 8 * R + 8);
    }

  // this thread's frequencies f_j = fp*FPW + 8j + gq and tokens 2cq + e of each 8-token n-tile:
  // phasors of the first n-tile (exact sincos) and the rotation by 8 tokens
  float pc[JT][2], ps[JT][2], rc[JT], rs[JT];
  const float p_first = static_cast<float>(pos0[b] + t0 + 2 * cq);
#pragma unroll
  for (int j = 0; j < JT; ++j) {
    const float th = inv_freq[fp * FPW + 8 * j + gq];
    sincosf(p_first * th, &ps[j][0], &pc[j][0]);
    sincosf((p_first + 1.0f) * th, &ps[j][1], &pc[j][1]);
    sincosf(8.0f * th, &rs[j], &rc[j]);
  }

  float* out = S + b * s_sb + u * s_sh;
  for (int i = 0; i < n_tiles; ++i) {
    const int slot = i % STAGES;
    mbar_wait(&full[slot], (i / STAGES) & 1);
    const uint32_t tile = smem_u32(tiles + slot * SLOT_BYTES);
    float v[16];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      // B fragments without ldmatrix: the fold's rank columns are permuted (`fold_query`) so that
      // thread (gq, cq) needs physical ranks [16 cq, 16 cq + 16) of token gq: two 16-byte loads,
      // odd tokens taking the halves in the other order so 8 lanes read 8 distinct bank groups
      const bool odd = gq & 1;
      const uint32_t addr = tile + (nt * 8 + gq) * ROW + 32 * cq;
      const uint4 lo = lds128(addr + (odd ? 16 : 0)), hi = lds128(addr + (odd ? 0 : 16));
      uint32_t bf[8];
      bf[0] = odd ? hi.x : lo.x;
      bf[1] = odd ? hi.y : lo.y;
      bf[2] = odd ? hi.z : lo.z;
      bf[3] = odd ? hi.w : lo.w;
      bf[4] = odd ? lo.x : hi.x;
      bf[5] = odd ? lo.y : hi.y;
      bf[6] = odd ? lo.z : hi.z;
      bf[7] = odd ? lo.w : hi.w;
      if (nt == 7) {  // every fragment of the slot is in registers: hand it back to the producer
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[slot]);
      }
      float acc[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int m = 0; m < MT; ++m) mma16816(acc[m], a[m][ks], bf[2 * ks], bf[2 * ks + 1]);
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int j = 0; j < JT; ++j) {
        const int m = j >> 1, h = (j & 1) * 2;  // a_f in acc[m][h + e], c_f in acc[m + MT/2][h + e]
        s0 = fmaf(pc[j][0], acc[m][h], fmaf(ps[j][0], acc[m + MT / 2][h], s0));
        s1 = fmaf(pc[j][1], acc[m][h + 1], fmaf(ps[j][1], acc[m + MT / 2][h + 1], s1));
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float c = pc[j][e], s = ps[j][e];
          pc[j][e] = c * rc[j] - s * rs[j];
          ps[j][e] = s * rc[j] + c * rs[j];
        }
      }
      v[2 * nt] = s0;
      v[2 * nt + 1] = s1;
    }
    // sum over the eight lanes sharing tokens; lane l ends with tokens 2l, 2l+1 of the slot
    float w[8], x[4], y[2];
    fold_half<8>(v, w, lane & 16, 16);
    fold_half<4>(w, x, lane & 8, 8);
    fold_half<2>(x, y, lane & 4, 4);
    if (RED) {
      const int t = t0 + i * TILE + 2 * lane;
      if (t < t_end) atomicAdd(out + t, y[0] * qk_scale);
      if (t + 1 < t_end) atomicAdd(out + t + 1, y[1] * qk_scale);
      continue;
    }
    float* buf = part + (qi * 2 + (i & 1)) * (FP - 1) * TILE;   // double-buffered per head
    if (fp > 0) {
      buf[(fp - 1) * TILE + 2 * lane] = y[0];
      buf[(fp - 1) * TILE + 2 * lane + 1] = y[1];
    }
    head_sync<NQ, 32 * FP>(qi);
    if (fp == 0) {
#pragma unroll
      for (int k = 0; k < FP - 1; ++k) {
        y[0] += buf[k * TILE + 2 * lane];
        y[1] += buf[k * TILE + 2 * lane + 1];
      }
      const int t = t0 + i * TILE + 2 * lane;
      if (t < t_end) out[t] = y[0] * qk_scale;
      if (t + 1 < t_end) out[t + 1] = y[1] * qk_scale;
    }
  }
}

#ifdef PALU_KERNEL_ONLY
#define PALU_INSTANTIATE(NQ_, FPW_, ST_)                                                                \
  template __global__ void rope_scores_kernel<NQ_, FPW_, ST_, 0>(                                         \
      const __half*, const __half*, const int*, const float*, float*, const int*, int, int, int, float, \
      long long, long long, long long, long long, long long);
PALU_INSTANTIATE(1, 32, 4)
PALU_INSTANTIATE(1, 16, 4)
PALU_INSTANTIATE(4, 16, 4)
PALU_INSTANTIATE(4, 32, 4)
template __global__ void rope_scores_kernel<1, 16, 4, 1>(const __half*, const __half*, const int*, const float*, float*, const int*, int, int, int, float, long long, long long, long long, long long, long long);
}  // namespace
#else
template <int NQ, int FPW, int STAGES>
constexpr int smem_bytes() { return tiles_offset<FPW>(NQ) + STAGES * SLOT_BYTES; }

template <int NQ, int FPW, int STAGES, int RED>
void launch(const torch::Tensor& hk, const torch::Tensor& fold, const torch::Tensor& pos0,
            const torch::Tensor& inv_freq, torch::Tensor& S, const torch::Tensor& lengths, int splits,
            int per_split, double qk_scale) {
  const int B = hk.size(0), G = hk.size(1), H = S.size(1);
  const int threads = 32 * (1 + HALF / FPW * NQ);
  constexpr int smem = smem_bytes<NQ, FPW, STAGES>();
  auto kernel = rope_scores_kernel<NQ, FPW, STAGES, RED>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<dim3(B * G, splits), threads, smem, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __half*>(hk.data_ptr<at::Half>()),
      reinterpret_cast<const __half*>(fold.data_ptr<at::Half>()), pos0.data_ptr<int>(),
      inv_freq.data_ptr<float>(), S.data_ptr<float>(), lengths.data_ptr<int>(), G, H, per_split,
      static_cast<float>(qk_scale), hk.stride(0), hk.stride(1), hk.stride(2), S.stride(0), S.stride(1));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int NQ, int FPW, int STAGES, int RED>
int resident() {
  const int threads = 32 * (1 + HALF / FPW * NQ);
  constexpr int smem = smem_bytes<NQ, FPW, STAGES>();
  auto kernel = rope_scores_kernel<NQ, FPW, STAGES, RED>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
  return n;
}

}  // namespace

// The compiled variants: (query heads per KV head, frequencies per consumer warp, ring slots).
#define PALU_VARIANTS(X) \
  X(1, 32, 4, 0) X(1, 16, 2, 0) X(1, 16, 4, 0) X(1, 16, 6, 0) X(4, 16, 4, 0) X(4, 32, 4, 0) X(1, 16, 4, 1) X(4, 16, 4, 1)

// hk [B, G, T, 64] fp16 (rank unit-stride, rows 16-byte aligned); fold [B, H, 64/fpw, 2 fpw, 64] fp16;
// pos0 [B] int32; inv_freq [64] fp32; S [B, H, T] fp32 (written for t < lengths[b]); lengths [B] int32.
void rope_scores(torch::Tensor hk, torch::Tensor fold, torch::Tensor pos0, torch::Tensor inv_freq,
                 torch::Tensor S, torch::Tensor lengths, int64_t nq, int64_t fpw, int64_t stages, int64_t red,
                 int64_t splits, int64_t per_split, double qk_scale) {
  const at::cuda::CUDAGuard guard(hk.device());
  bool done = false;
#define RUN(NQ_, FPW_, ST_, RED_)                                                                \
  if (!done && nq == NQ_ && fpw == FPW_ && stages == ST_ && red == RED_) {                      \
    launch<NQ_, FPW_, ST_, RED_>(hk, fold, pos0, inv_freq, S, lengths, splits, per_split, qk_scale); \
    done = true;                                                                                 \
  }
  PALU_VARIANTS(RUN)
#undef RUN
  TORCH_CHECK(done, "rope_scores: no compiled variant for nq=", nq, ", fpw=", fpw, ", stages=", stages, ", red=", red);
}

int64_t resident_ctas(int64_t nq, int64_t fpw, int64_t stages, int64_t red) {
  int n = -1;
#define RUN(NQ_, FPW_, ST_, RED_) \
  if (n < 0 && nq == NQ_ && fpw == FPW_ && stages == ST_ && red == RED_) n = resident<NQ_, FPW_, ST_, RED_>();
  PALU_VARIANTS(RUN)
#undef RUN
  TORCH_CHECK(n >= 0, "resident_ctas: no compiled variant for nq=", nq, ", fpw=", fpw, ", stages=", stages, ", red=", red);
  return n;
}

std::vector<std::vector<int64_t>> variants() {
  std::vector<std::vector<int64_t>> v;
#define RUN(NQ_, FPW_, ST_, RED_) v.push_back({NQ_, FPW_, ST_, RED_});
  PALU_VARIANTS(RUN)
#undef RUN
  return v;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_scores", &rope_scores, "warp-specialised RoPE scores over M-LRD latents (sm_90a)");
  m.def("resident_ctas", &resident_ctas, "CTAs of one variant resident per SM");
  m.def("variants", &variants, "the compiled (query heads, frequencies per warp, ring slots)");
}
#endif  // PALU_KERNEL_ONLY

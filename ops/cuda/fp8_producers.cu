// CUDA FP8 producers (kernels/norm.h rms_norm_fp8_forward, kernels/activation.h swiglu_fp8_forward):
// RMSNorm (optionally after the residual add) and SwiGLU that write, in the same pass as their bf16
// output y, its FP8 copy for linear_fp8: X8 [Rp, C] and X8T [C, Rp] (kernels/fp8.h Fp8CastTarget),
// the codes of the stored (bf16-rounded) y, the amax folded as the standalone cast would. The bits
// are those of the plain kernel followed by the cast.
//
// RMSNorm: a row is a block-wide job in norm.cu (the row in registers, one block reduction), and its
// result must be bit for bit that kernel's, so the row is the same code (rms_row.cuh) run by a
// *team* of the same number of threads, with the same reduction tree over a named barrier. A block
// of 512 threads holds 512 / team teams and owns groups of G consecutive rows (G = 32 up to 2048
// columns, 16 up to 4096, else 8: a 64 KB tile, 3 blocks per SM): the teams share out a group's rows,
// each writing y, the row's X8 codes (one 8-byte store per 8 columns) and the same codes into a
// G x C shared tile; then the block writes X8T from the tile, 4 columns x 16 rows per thread as
// 16-byte column segments (8-byte ones for G = 8; fp8_codes.cuh). Not taken (the op then runs the
// plain kernel and the cast): other dtypes than bf16, unaligned or short-vector rows, rows too long
// for the registers path (the plain kernel streams those).
//
// SwiGLU: fp8_codes.cuh's 128 x 128 tile kernel with a source that computes y from gate and up
// (activation_math.cuh's formula, as activation.cu) and stores it.
#include <algorithm>

#include "cuda/activation_math.cuh"
#include "cuda/fp8_codes.cuh"
#include "cuda/rms_row.cuh"
#include "kernels/activation.h"
#include "kernels/norm.h"

namespace kestrel::cuda_ops {
namespace {

// Blocks of 512 threads, 3 per SM (42 registers; a few bytes spill for CH = 2, loop invariants). At 1024
// threads the kernel takes 62 registers, so one block per SM: two thirds of the rows in flight.
constexpr int kNormBlockThreads = 512, kNormBlocksPerSm = 3;
constexpr int kMaxTeams = kNormBlockThreads / 64;  // teams of >= 64 threads (row_launch); named barriers 1..8
constexpr int64_t kTileBudget = 64 * 1024;         // shared tile per block, for 3 blocks per SM
constexpr int64_t kMaxTileBytes = 200 * 1024;      // H200: 227 KB of shared memory per block at most

// y, h [R, C] bf16, x / res [R, C], rstd [R], w [C]; a.out [Rp, C], a.out_t [C, Rp] (kTrans).
// blockDim = teams * team_threads; dynamic shared memory group_rows * C bytes when kTrans.
template <int CH, bool ADD, bool kTrans>
__global__ __launch_bounds__(kNormBlockThreads, kNormBlocksPerSm) void rms_fp8_kernel(bf16_t* __restrict__ y, bf16_t* __restrict__ h,
                                                                    float* __restrict__ rstd,
                                                                    const bf16_t* __restrict__ x,
                                                                    const bf16_t* __restrict__ res,
                                                                    const bf16_t* __restrict__ w, int64_t R,
                                                                    int64_t C, float eps, fp8::CastArgs a,
                                                                    int team_threads, int group_rows) {
  constexpr int V = 8;  // bf16 elements per 16-byte chunk: 8 codes, one 8-byte store
  extern __shared__ __align__(16) uint8_t tile[];  // [group_rows][C] codes (kTrans)
  __shared__ float red_buf[kMaxTeams][2][32];
  const int teams = blockDim.x / team_threads, team = threadIdx.x / team_threads;
  const int t = threadIdx.x - team * team_threads;
  TeamSum red(red_buf[team], 1 + team, team_threads, t);
  const float s = *a.scale;
  uint32_t m = 0;
  const int64_t groups = (a.Rp + group_rows - 1) / group_rows;
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const int64_t r0 = g * group_rows;
    const int rows = static_cast<int>(min(static_cast<int64_t>(group_rows), a.Rp - r0));  // a multiple of 8
    for (int i = team; i < rows; i += teams) {
      const int64_t r = r0 + i;
      uint8_t* trow = tile + static_cast<int64_t>(i) * C;
      if (r < R) {
        rms_row<bf16_t, V, CH, ADD>(y, h, rstd, x + r * C, ADD ? res + r * C : nullptr, w, r, C, eps, red, t,
                                    team_threads, [&](int64_t c, const Pack<bf16_t, V>& yv) {
                                      float v[8];
#pragma unroll
                                      for (int j = 0; j < 8; ++j) v[j] = to_f32(yv.v[j]);
                                      const uint2 p = fp8::codes8(v, s, a.fmt, m);
                                      *reinterpret_cast<uint2*>(a.out + r * C + c) = p;
                                      if constexpr (kTrans) *reinterpret_cast<uint2*>(trow + c) = p;
                                    });
      } else {  // a padding row of the GEMM operand: code 0
        for (int64_t c = static_cast<int64_t>(t) * 16; c < C; c += static_cast<int64_t>(team_threads) * 16) {
          *reinterpret_cast<uint4*>(a.out + r * C + c) = make_uint4(0u, 0u, 0u, 0u);
          if constexpr (kTrans) *reinterpret_cast<uint4*>(trow + c) = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
    if constexpr (kTrans) {
      __syncthreads();
      // Units of 4 columns x 16 rows (x 8 when the group has 8 rows).
      const int unit_rows = rows >= 16 ? 16 : 8;
      const int64_t col_groups = C / 4, units = col_groups * (rows / unit_rows);
      for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
        const int64_t cg = u % col_groups, rg = u / col_groups;
        uint32_t wv[16];
#pragma unroll
        for (int i = 0; i < 16; ++i)
          wv[i] = i < unit_rows ? *reinterpret_cast<const uint32_t*>(tile + (unit_rows * rg + i) * C + 4 * cg) : 0u;
        fp8::store_transposed_4x16(a.out_t, a.Rp, 4 * cg, r0 + unit_rows * rg, wv, unit_rows);
      }
      __syncthreads();  // the next group rewrites the tile
    }
  }
  if (a.amax) fp8::fold_amax(a.amax, m);
  fp8::write_scales(a.scales_out, s);
}

bool aligned_all(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->defined() && !aligned16(t->data_ptr())) return false;
  return true;
}

bool rms_norm_fp8_cuda(const Tensor& y, const Tensor& h, const Tensor& rstd, const Tensor& x, const Tensor& res,
                       const Tensor& w, double eps, const kernels::Fp8CastTarget& e) {
  const int64_t R = x.shape()[0], C = x.shape()[1], Rp = e.padded_rows();
  if (x.dtype() != DType::BF16 || !e.out.defined() || C % 16 != 0 || Rp % 16 != 0 || Rp < R) return false;
  if (!aligned_all({&y, &h, &x, &res, &w, &e.out, &e.out_t})) return false;
  // The plain kernel's block for these rows (norm.cu: row_launch at 8-wide chunks): a team is that.
  const RowLaunch L = row_launch(C, 8);
  if (L.chunks > kRowMaxChunks) return false;  // the plain kernel streams such rows; not fused
  const bool trans = e.out_t.defined();
  // Rows per group: the most of 32, 16, 8 whose tile fits the budget (X8T segments of that many bytes).
  int group_rows = 32;
  while (trans && group_rows > 8 && group_rows * C > kTileBudget) group_rows /= 2;
  const int64_t smem = trans ? group_rows * C : 0;
  if (smem > kMaxTileBytes) return false;
  const int teams = std::min(kMaxTeams, kNormBlockThreads / L.threads), threads = teams * L.threads;
  auto launch = [&](auto kernel) {
    if (smem > 48 * 1024)
      KESTREL_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    int per_sm = 0;
    KESTREL_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    if (per_sm == 0) return false;
    const int64_t groups = ceil_div(Rp, group_rows);
    const auto grid = static_cast<unsigned>(std::clamp<int64_t>(groups, 1, int64_t{per_sm} * sm_count()));
    kernel<<<grid, threads, smem, cuda::current_stream()>>>(
        ptr<bf16_t>(y), h.defined() ? ptr<bf16_t>(h) : nullptr, ptr<float>(rstd), ptr<const bf16_t>(x),
        res.defined() ? ptr<const bf16_t>(res) : nullptr, ptr<const bf16_t>(w), R, C, static_cast<float>(eps),
        fp8::cast_args(e, Rp), L.threads, group_rows);
    KESTREL_CUDA_CHECK_LAUNCH();
    return true;
  };
  auto with = [&](auto ch, auto add) {
    constexpr int CH = decltype(ch)::value;
    constexpr bool ADD = decltype(add)::value;
    return trans ? launch(rms_fp8_kernel<CH, ADD, true>) : launch(rms_fp8_kernel<CH, ADD, false>);
  };
  using Two = std::integral_constant<int, 2>;
  using Four = std::integral_constant<int, 4>;
  if (res.defined())
    return L.chunks <= 2 ? with(Two{}, std::true_type{}) : with(Four{}, std::true_type{});
  return L.chunks <= 2 ? with(Two{}, std::false_type{}) : with(Four{}, std::false_type{});
}

// y = swiglu(gate, up) [R, C] bf16 as the tile kernel's source: y stored, its values cast.
struct SwigluSource {
  static constexpr int kBatch = 2;  // 32 bytes of loads per unit: a quarter of the units in flight at once
  struct Raw {
    Vec<bf16_t> g, u;
  };
  const bf16_t* __restrict__ gate;
  const bf16_t* __restrict__ up;
  bf16_t* __restrict__ y;
  int64_t C;
  __device__ __forceinline__ Raw fetch(int64_t r, int64_t c) const {
    return {load_vec(gate + r * C + c), load_vec(up + r * C + c)};
  }
  __device__ __forceinline__ void finish(const Raw& w, int64_t r, int64_t c, float (&v)[8]) const {
    Vec<bf16_t> o;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      o.v[j] = from_f32<bf16_t>(swiglu_f32(to_f32(w.g.v[j]), to_f32(w.u.v[j])));
      v[j] = to_f32(o.v[j]);
    }
    store_vec(y + r * C + c, o);
  }
};

bool swiglu_fp8_cuda(const Tensor& out, const Tensor& gate, const Tensor& up, const kernels::Fp8CastTarget& e) {
  const int64_t R = out.shape()[0], C = out.shape()[1];
  if (out.dtype() != DType::BF16 || !e.out.defined() || e.padded_rows() < R) return false;
  const fp8::CastArgs a = fp8::cast_args(e, e.padded_rows());
  if (!fp8::tile_path_fits(a, C) || !aligned_all({&out, &gate, &up})) return false;
  fp8::launch_cast_tile(SwigluSource{ptr<const bf16_t>(gate), ptr<const bf16_t>(up), ptr<bf16_t>(out), C}, a, R, C);
  return true;
}

}  // namespace

KESTREL_REGISTER_KERNEL(rms_norm_fp8_forward, cuda, rms_norm_fp8_cuda);
KESTREL_REGISTER_KERNEL(swiglu_fp8_forward, cuda, swiglu_fp8_cuda);

}  // namespace kestrel::cuda_ops

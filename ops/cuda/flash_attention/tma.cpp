// Host side of tma.cuh: tensor maps for the TMA flash attention kernels, encoded
// through the driver's cuTensorMapEncodeTiled (looked up via cudart, so libkestrel does not link
// libcuda directly).
#include "cuda/flash_attention/tma.cuh"

#include <cuda_runtime.h>

#include "kestrel/cuda/check.h"
#include "kestrel/runtime/error.h"

namespace kestrel::cuda::fa {
namespace {

using EncodeTiled = decltype(&cuTensorMapEncodeTiled);

EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    KESTREL_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
    KESTREL_CHECK(p && q == cudaDriverEntryPointSuccess, "flash_attention", "driver function cuTensorMapEncodeTiled not found");
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

}  // namespace

namespace {

// [tokens, heads, dim] of `elem_bytes`-byte elements, boxes of box_cols x 1 x box_rows, 128-byte swizzle.
CUtensorMap encode_3d(const void* base, CUtensorMapDataType type, int elem_bytes, int tokens, int heads, int dim,
                      int box_cols, int box_rows) {
  KESTREL_CHECK(tokens > 0 && heads > 0 && dim > 0 && dim * elem_bytes % 16 == 0, "flash_attention",
                "TMA map needs tokens (", tokens, "), heads (", heads, ") > 0 and rows of a multiple of 16 bytes (",
                dim, " x ", elem_bytes, ")");
  KESTREL_CHECK(box_rows > 0 && box_rows <= 256, "flash_attention", "TMA box rows must be in [1, 256], got ", box_rows);
  CUtensorMap map{};
  const cuuint64_t size[3] = {static_cast<cuuint64_t>(dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(tokens)};
  const cuuint64_t stride[2] = {static_cast<cuuint64_t>(dim) * elem_bytes,
                                static_cast<cuuint64_t>(heads) * dim * elem_bytes};  // bytes
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_cols), 1, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_stride[3] = {1, 1, 1};
  const CUresult r = encode_tiled()(&map, type, 3, const_cast<void*>(base), size, stride, box, elem_stride,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  KESTREL_CHECK(r == CUDA_SUCCESS, "flash_attention", "cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(r),
                ") for a [", tokens, ", ", heads, ", ", dim, "] tensor at ", base);
  return map;
}

}  // namespace

CUtensorMap make_tma_map_3d(const void* base, AttnDType dtype, int tokens, int heads, int dim, int box_rows) {
  KESTREL_CHECK(dim % 8 == 0, "flash_attention", "TMA map needs a head_dim multiple of 8, got ", dim);
  return encode_3d(base, dtype == AttnDType::BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                   tokens, heads, dim, 64, box_rows);
}

CUtensorMap make_tma_map_3d_f32(float* base, int tokens, int heads, int dim, int box_rows) {
  return encode_3d(base, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, tokens, heads, dim, 32, box_rows);
}

}  // namespace kestrel::cuda::fa

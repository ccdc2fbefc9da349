// Parameter validation and kernel choice (heuristics.h). Measurements behind the choices:
// bench/notes/flash_attention.md.
#include "cuda/flash_attention/heuristics.h"

#include <atomic>
#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/flash_attention/traits.h"
#include "kestrel/cuda/check.h"
#include "kestrel/cuda/context.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/log.h"

namespace kestrel::cuda::fa {

DeviceProps current_device_props() {
  static std::atomic<int> cached_cc[64] = {};  // 10 * major + minor, 0 = not read yet
  const int device = current_device();
  int cc = device < 64 ? cached_cc[device].load(std::memory_order_relaxed) : 0;
  if (cc == 0) {
    int major = 0, minor = 0;
    KESTREL_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    KESTREL_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    cc = 10 * major + minor;
    if (device < 64) cached_cc[device].store(cc, std::memory_order_relaxed);
  }
  return DeviceProps{cc / 10, cc % 10, sm_count(device)};
}

void check_params(const FlashAttentionParams& p) {
  KESTREL_CHECK(p.q && p.k && p.v && p.out && p.lse, "flash_attention", "q, k, v, out and lse must be non-null");
  KESTREL_CHECK(p.cu_seqlens_q && p.cu_seqlens_k, "flash_attention", "cu_seqlens_q/k must be non-null");
  KESTREL_CHECK(p.num_docs >= 0 && p.num_docs <= 65535, "flash_attention", "num_docs must be in [0, 65535], got ",
                p.num_docs);
  KESTREL_CHECK(p.max_seqlen_q >= 0 && p.max_seqlen_k >= 0, "flash_attention", "max_seqlen must be >= 0");
  // Grid y of the forward (query tiles of >= 64 rows) and of the backward (key blocks of >= 64 keys).
  KESTREL_CHECK(p.max_seqlen_q / 64 < 65535 && p.max_seqlen_k / 64 < 65535, "flash_attention",
                "max_seqlen_q/k too large: ", p.max_seqlen_q, ", ", p.max_seqlen_k);
  KESTREL_CHECK(p.total_q >= p.max_seqlen_q && p.total_k >= p.max_seqlen_k, "flash_attention",
                "total_q/total_k (the token counts of q and k/v) are required and must cover the longest document: "
                "got total_q ", p.total_q, ", total_k ", p.total_k, " with max_seqlen_q ", p.max_seqlen_q,
                ", max_seqlen_k ", p.max_seqlen_k);
  KESTREL_CHECK(p.num_heads_q > 0 && p.num_heads_kv > 0 && p.num_heads_q % p.num_heads_kv == 0, "flash_attention",
                "num_heads_q (", p.num_heads_q, ") must be a positive multiple of num_heads_kv (", p.num_heads_kv,
                ")");
  KESTREL_CHECK(p.head_dim > 0 && p.head_dim <= 256 && p.head_dim % 8 == 0, "flash_attention",
                "head_dim must be a multiple of 8 in [8, 256], got ", p.head_dim);
  KESTREL_CHECK(p.window >= 0, "flash_attention", "window must be >= 0 (0 = none), got ", p.window);
  KESTREL_CHECK(p.window == 0 || p.causal, "flash_attention",
                "a sliding window is implemented for causal attention only (window ", p.window, ", causal false)");
  KESTREL_CHECK(!p.prefix_len || (p.causal && p.window == 0), "flash_attention",
                "a prefix-LM mask (prefix_len) needs causal attention without a window");
  if (p.block_mask) {
    const FlashBlockMask& m = *p.block_mask;
    KESTREL_CHECK(!p.causal && p.window == 0 && !p.prefix_len, "flash_attention",
                  "a block mask combines with causal = false only (no window, no prefix_len)");
    KESTREL_CHECK(p.num_docs == 1 && p.max_seqlen_q == p.total_q && p.max_seqlen_k == p.total_k, "flash_attention",
                  "a block mask describes one document spanning q and k: num_docs 1 and max_seqlen_q/k = total_q/k, "
                  "got ", p.num_docs, " documents, max_seqlen ", p.max_seqlen_q, "/", p.max_seqlen_k, ", total ",
                  p.total_q, "/", p.total_k);
    KESTREL_CHECK(m.q_ptr && m.q_kblock && m.q_kind && m.k_ptr && m.k_qblock && m.k_kind && m.bits && m.bits_t,
                  "flash_attention", "block mask: every array of FlashBlockMask must be set");
    KESTREL_CHECK(reinterpret_cast<uintptr_t>(m.bits) % 16 == 0 && reinterpret_cast<uintptr_t>(m.bits_t) % 16 == 0,
                  "flash_attention", "block mask: bits and bits_t must be 16-byte aligned");
  }
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  KESTREL_CHECK(aligned(p.q) && aligned(p.k) && aligned(p.v) && aligned(p.out), "flash_attention",
                "q, k, v and out must be 16-byte aligned");
}

namespace {

void announce_padding(int head_dim, int padded) {
  if (head_dim == padded) return;
  static std::atomic<bool> announced{false};
  if (!announced.exchange(true))
    log_to(LogLevel::Info, "flash_attention", "head_dim ", head_dim, " runs the zero-padded head_dim-", padded,
           " kernels (64, 80, 96, 112 and 128 are built on sm_90, 256 elsewhere)");
}

}  // namespace

int hopper_head_dim(const FlashAttentionParams& p, bool backward, bool narrow) {
  if (p.head_dim <= 64) return 64;  // 8..56: padded to 64 (one k-step of 16 is the floor below 64 too)
  const int rounded = (p.head_dim + 15) / 16 * 16;
  // The narrow widths are built without the prefix-LM and deterministic variants (traits.h).
  const bool variant = p.prefix_len != nullptr || p.block_mask != nullptr || (backward && p.deterministic);
  if (!narrow || variant || !is_narrow_head_dim(rounded)) return 128;
  return rounded;
}

KernelChoice choose_kernel(const FlashAttentionParams& p, const DeviceProps& dev, bool backward) {
  const bool hopper = dev.cc_major == 9;  // the wgmma/TMA kernels are built for sm_90a
  FlashKernel k = p.kernel;
  if (k == FlashKernel::Auto) k = hopper && p.head_dim <= 128 ? FlashKernel::Hopper : FlashKernel::MmaSync;
  const bool narrow = k != FlashKernel::HopperPadded;
  if (k == FlashKernel::HopperPadded) k = FlashKernel::Hopper;
  KernelChoice c{k, 256};
  if (k == FlashKernel::Hopper) {
    KESTREL_CHECK(hopper, "flash_attention", "the Hopper kernels need an sm_90 device, this one is sm_", dev.cc_major,
                  dev.cc_minor);
    KESTREL_CHECK(p.head_dim <= 128, "flash_attention", "the Hopper kernels run head dims up to 128, got ",
                  p.head_dim);
    c.kernel_head_dim = hopper_head_dim(p, backward, narrow);
  }
  KESTREL_CHECK(!p.block_mask || k == FlashKernel::Hopper, "flash_attention",
                "a block mask is implemented by the Hopper kernels (sm_90, head_dim <= 128); head_dim ", p.head_dim,
                " on sm_", dev.cc_major, dev.cc_minor, " would run the mma.sync kernels, which do not implement it");
  KESTREL_CHECK(!(backward && p.deterministic && p.block_mask), "flash_attention",
                "the deterministic backward is not built with a block mask (its dq order assumes contiguous key "
                "ranges); pass deterministic = false");
  KESTREL_CHECK(!(backward && p.deterministic && k == FlashKernel::MmaSync), "flash_attention",
                "deterministic backward is implemented by the Hopper kernel (sm_90, head_dim <= 128); head_dim ",
                p.head_dim, " on sm_", dev.cc_major, dev.cc_minor, " runs the mma.sync kernel, which adds dq in "
                "arrival order");
  if (backward) {
    const bool built = k == FlashKernel::Hopper &&
                       bwd_ws_built(c.kernel_head_dim, p.deterministic, p.block_mask != nullptr);
    KESTREL_CHECK(p.bwd_layout != FlashBwdLayout::Specialised || built, "flash_attention",
                  "bwd_layout Specialised is built for the Hopper backward at kernel head dims 80-128 without "
                  "deterministic or a block mask; this call runs ",
                  k == FlashKernel::Hopper ? "the Hopper kernel" : "the mma.sync kernel", " at kernel head dim ",
                  c.kernel_head_dim, p.deterministic ? ", deterministic" : "", p.block_mask ? ", block mask" : "",
                  "; use Auto or Plain");
    // Auto: wherever it is built; it measured faster at every built head dim, causal or not
    // (bench/notes/flash_attention.md, fourteenth session).
    c.bwd_specialised = built && p.bwd_layout != FlashBwdLayout::Plain;
  }
  announce_padding(p.head_dim, c.kernel_head_dim);
  return c;
}

}  // namespace kestrel::cuda::fa

// cuDNN's fused flash attention as Kestrel's second attention backend (attention_backend.h): one
// cuDNN handle per device (created lazily, bound to current_stream() per call), execution plans
// cached per shape bucket, the per-call metadata (document lengths, ragged offsets) written by one
// small kernel from cu_seqlens (no host sync), every workspace byte from the caching allocator
// under MemoryTag::Workspace.
//
// Plan cache: a plan is keyed by (io dtype, documents B, Hq, Hkv, D, S_q, S_k, causal, direction,
// plan choice) with B and S rounded up (bucket(): B exact up to 2 then two steps per power of two,
// S in 256-token steps up to 512 then two steps per power of two), so the document mixes of a training
// run reuse a few dozen plans: every new plan is a host-side build (finalisation) that the step waits
// for (the 1.5B at 8k with 8 steps per octave built new plans on most of its first 40 steps, 500-750 ms
// each, against 135-140 ms with every plan cached; bench/RESULTS.md). The grid covers the bucket: the
// rows and tiles past the real documents exit early. The rows past
// the real documents get length 0; S only bounds the longest document (the padding mask does the rest).
//
// Plan choice (CudnnPlanChoice, attention_backend.h): First keeps the first engine config of
// heuristics mode A that finalises. Fastest (the default) finalises up to kCudnnPlanCandidates
// configs and, on the call that built them, runs each once (kernel load) and then
// kCudnnPlanTimedRuns times between CUDA events on the current stream, on that call's own buffers:
// every output (out and lse; dq, dk, dv) is overwritten, never accumulated, so the timing runs leave
// nothing behind; the workspace is sized for the largest candidate. The fastest plan is kept, the
// others destroyed. Every plan built is recorded with its candidates' engines, knobs and times
// (cudnn_attention_plan_log). A stream under capture is not timed (the first candidate is kept).
//
// Memory: the workspace (the plan's own, plus in the backward the f32 dQ accumulator, the
// softmax_sum rows and, for GQA, full-head dK / dV) is one Tensor::empty per call; what cuDNN's
// handle and the kernels it loads take on the device is measured with refresh_external around
// cudnnCreate and around each new plan's build and first run, so it counts as External against the
// budget (cudnn_attention_external_bytes reports the sum).
#include <cudnn_graph.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/attention_backend.h"
#include "cuda/common.cuh"
#include "cuda/cudnn_attention/backend.h"
#include "cuda/cudnn_attention/graphs.h"
#include "kestrel/cuda/memory.h"
#include "kestrel/runtime/memory.h"

namespace kestrel::cuda_ops {
namespace {

using cudnn::BuiltGraph;
using cudnn::GraphShape;

struct PlanKey {
  int io;
  int64_t b, hq, hkv, d, sq, sk;
  bool causal, backward;
  CudnnPlanChoice choice;
  auto tie() const { return std::tie(io, b, hq, hkv, d, sq, sk, causal, backward, choice); }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

struct CachedPlan {
  BuiltGraph graph;     // graph.plans: the candidates until chosen, then the chosen plan alone
  bool chosen = false;  // graph.plans[0] is the plan to run
  bool ran = false;     // the first run loads the engine's kernels: External is re-measured after it
  size_t log_index = 0;        // its record in DeviceState::log
  std::vector<int> log_slots;  // graph.plans[i]'s index in the record's candidates
  // The workspace a call needs for the plan: the largest candidate's until chosen.
  int64_t workspace() const {
    int64_t w = 0;
    for (const auto& c : graph.plans) w = std::max(w, c.workspace);
    return w;
  }
};

struct DeviceState {
  std::mutex mu;  // handle, cache, log and the handle's stream binding: one call at a time per device
  cudnnHandle_t handle = nullptr;
  std::map<PlanKey, std::unique_ptr<CachedPlan>> plans;
  std::vector<CudnnPlanRecord> log;
  int64_t external = 0;
};

constexpr int kMaxDevices = 64;
DeviceState& device_state(int device) {
  KESTREL_CHECK(device >= 0 && device < kMaxDevices, "attention", "cuDNN backend: device ", device, " out of range");
  // Never destroyed, like the CUDA contexts: plans and handles outlive static destructors, which
  // may run after the driver has shut down.
  static DeviceState* states = new DeviceState[kMaxDevices];
  return states[device];
}

// x rounded up: to step_min at least, exact multiples of step_min up to `per_octave` * step_min, then
// to 1/per_octave of its power of two (at most 100% / per_octave more).
int64_t bucket(int64_t x, int64_t step_min, int64_t per_octave) {
  if (x <= step_min) return step_min;
  int64_t pow2 = 1;
  while (pow2 * 2 <= x) pow2 *= 2;
  const int64_t step = std::max(step_min, pow2 / per_octave);
  return (x + step - 1) / step * step;
}

cudnnHandle_t handle_for(DeviceState& st, int device) {  // under st.mu
  if (!st.handle) {
    const int64_t before = cuda::refresh_external(device);
    KESTREL_CUDNN_CHECK(cudnnCreate(&st.handle));
    st.external += std::max<int64_t>(0, cuda::refresh_external(device) - before);
  }
  return st.handle;
}


// Per-document lengths and ragged offsets (elements) from cu_seqlens, for B >= docs plan rows: the
// rows past the documents have length 0 and start at the end.
__global__ void ragged_offsets_kernel(const int32_t* __restrict__ cu_q, const int32_t* __restrict__ cu_k, int docs,
                                      int b, int64_t q_row, int64_t k_row, int64_t stats_row, int32_t* seq_q,
                                      int32_t* seq_k, int64_t* off_q, int64_t* off_k, int64_t* off_stats) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i <= b; i += blockDim.x * gridDim.x) {
    const int doc = min(i, docs);
    const int64_t cq = cu_q[doc], ck = cu_k[doc];
    off_q[i] = cq * q_row;
    off_k[i] = ck * k_row;
    off_stats[i] = cq * stats_row;
    if (i < b) {
      seq_q[i] = i < docs ? cu_q[i + 1] - static_cast<int32_t>(cq) : 0;
      seq_k[i] = i < docs ? cu_k[i + 1] - static_cast<int32_t>(ck) : 0;
    }
  }
}

// One workspace allocation carved into 256-byte aligned pieces.
struct Carve {
  int64_t bytes = 0;
  int64_t take(int64_t n) {
    const int64_t at = bytes;
    bytes += (std::max<int64_t>(n, 1) + 255) / 256 * 256;
    return at;
  }
};

// The call's plan shape, metadata and the pointers every graph reads.
struct Call {
  PlanKey key;
  int docs = 0;
  int64_t total_q = 0, total_k = 0, max_seqlen_q = 0;
  float scale = 0, neg_inf = 0, one = 1;
  std::vector<int64_t> uids;
  std::vector<void*> ptrs;
  void add(int64_t uid, const void* p) {
    uids.push_back(uid);
    ptrs.push_back(const_cast<void*>(p));
  }
};

Call make_call(const Tensor& q, const Tensor& k, const Tensor& cq, const kernels::AttentionParams& p, bool backward) {
  Call c;
  c.docs = static_cast<int>(cq.numel() - 1);
  c.total_q = q.shape()[0];
  c.total_k = k.shape()[0];
  c.key.io = q.dtype() == DType::BF16 ? 0 : 1;
  c.key.b = bucket(c.docs, 1, 2);  // 1, 2, 3, 4, 6, 8, 12, 16, ...
  c.key.hq = q.shape()[1];
  c.key.hkv = k.shape()[1];
  c.key.d = q.shape()[2];
  c.key.sq = bucket(p.max_seqlen_q, 256, 2);  // 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, ...
  c.key.sk = bucket(p.max_seqlen_k, 256, 2);
  if (p.causal) c.key.sq = c.key.sk = std::max(c.key.sq, c.key.sk);
  c.key.causal = p.causal;
  c.key.backward = backward;
  c.key.choice = cudnn_plan_choice();
  c.max_seqlen_q = p.max_seqlen_q;
  c.scale = static_cast<float>(p.softmax_scale);
  c.neg_inf = -std::numeric_limits<float>::infinity();
  return c;
}

// The cached plan for the call's bucket, built (its candidates finalised and logged) on first use;
// external_before: External just before a new plan's build (0 for a cached plan).
CachedPlan& plan_for(DeviceState& st, int device, const Call& c, int64_t* external_before) {  // under st.mu
  const PlanKey& key = c.key;
  auto it = st.plans.find(key);
  if (it != st.plans.end()) return *it->second;
  cudnnHandle_t h = handle_for(st, device);
  *external_before = cuda::refresh_external(device);
  GraphShape s;
  s.io = key.io == 0 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
  s.b = key.b, s.hq = key.hq, s.hkv = key.hkv, s.d = key.d, s.sq = key.sq, s.sk = key.sk, s.causal = key.causal;
  const int max_plans = key.choice == CudnnPlanChoice::First ? 1 : kCudnnPlanCandidates;
  auto plan = std::make_unique<CachedPlan>();
  const auto build_start = std::chrono::steady_clock::now();
  plan->graph =
      key.backward ? cudnn::build_backward_graph(h, s, max_plans) : cudnn::build_forward_graph(h, s, max_plans);
  CudnnPlanRecord r;
  r.build_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - build_start).count();
  r.backward = key.backward;
  r.dtype = key.io == 0 ? "bf16" : "f16";
  r.b = key.b, r.hq = key.hq, r.hkv = key.hkv, r.d = key.d, r.sq = key.sq, r.sk = key.sk, r.causal = key.causal;
  r.choice = key.choice;
  r.docs = c.docs, r.tokens_q = c.total_q, r.max_seqlen_q = c.max_seqlen_q;
  // Candidates past the first whose workspace would exceed the first's and kCudnnPlanMaxWorkspace
  // (an engine that materialises the scores) are logged, not run.
  auto& plans = plan->graph.plans;
  const int64_t max_workspace = std::max(plans[0].workspace, kCudnnPlanMaxWorkspace);
  std::vector<cudnn::PlanCandidate> kept;
  for (cudnn::PlanCandidate& p : plans) {
    const bool skip = p.workspace > max_workspace;
    r.candidates.push_back(CudnnPlanCandidate{p.engine, p.knobs, p.heuristics, p.workspace, skip ? -3.0 : -1.0});
    if (skip) continue;
    plan->log_slots.push_back(static_cast<int>(r.candidates.size()) - 1);
    kept.push_back(std::move(p));
  }
  plans = std::move(kept);
  plan->chosen = plans.size() == 1;
  r.chosen = plan->chosen ? plan->log_slots[0] : -1;
  plan->log_index = st.log.size();
  st.log.push_back(std::move(r));
  return *st.plans.emplace(key, std::move(plan)).first->second;
}

// The pieces every call carves first (byte offsets): the plan's own workspace, then the per-document
// lengths (i32 [B]) and ragged offsets (i64 [B + 1]).
struct MetadataPieces {
  int64_t plan, seq_q, seq_k, off_q, off_k, off_stats;
};
MetadataPieces carve_metadata(Carve& w, int64_t plan_workspace, int64_t b) {
  MetadataPieces m;
  m.plan = w.take(plan_workspace);
  m.seq_q = w.take(4 * b);
  m.seq_k = w.take(4 * b);
  m.off_q = w.take(8 * (b + 1));
  m.off_k = w.take(8 * (b + 1));
  m.off_stats = w.take(8 * (b + 1));
  return m;
}

// Writes the metadata into the workspace (at its carved offsets) and adds the uids every graph shares.
void add_metadata(Call& c, uint8_t* ws, const MetadataPieces& m, const Tensor& cq, const Tensor& ck,
                  cudaStream_t stream) {
  auto* seq_q = reinterpret_cast<int32_t*>(ws + m.seq_q);
  auto* seq_k = reinterpret_cast<int32_t*>(ws + m.seq_k);
  auto* off_q = reinterpret_cast<int64_t*>(ws + m.off_q);
  auto* off_k = reinterpret_cast<int64_t*>(ws + m.off_k);
  auto* off_stats = reinterpret_cast<int64_t*>(ws + m.off_stats);
  const int b = static_cast<int>(c.key.b);
  ragged_offsets_kernel<<<(b + 1 + 255) / 256, 256, 0, stream>>>(
      static_cast<const int32_t*>(cq.data_ptr()), static_cast<const int32_t*>(ck.data_ptr()), c.docs, b,
      c.key.hq * c.key.d, c.key.hkv * c.key.d, c.key.hq, seq_q, seq_k, off_q, off_k, off_stats);
  KESTREL_CUDA_CHECK_LAUNCH();
  c.add(cudnn::kSeqQ, seq_q);
  c.add(cudnn::kSeqKV, seq_k);
  c.add(cudnn::kOffQ, off_q);
  c.add(cudnn::kOffK, off_k);
  c.add(cudnn::kOffV, off_k);  // v is laid out like k, out / dout like q
  c.add(cudnn::kOffO, off_q);
  c.add(cudnn::kOffStats, off_stats);
  c.add(cudnn::kScale, &c.scale);  // by value: host pointers, read by cudnnBackendExecute
  c.add(cudnn::kNegInf, &c.neg_inf);
}

// A pair of timing events on one stream (RAII).
struct EventPair {
  cudaEvent_t start = nullptr, stop = nullptr;
  EventPair() {
    KESTREL_CUDA_CHECK(cudaEventCreate(&start));
    KESTREL_CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~EventPair() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
};

// CudnnPlanChoice::Fastest: runs every candidate on the call's buffers (once to load it, then
// kCudnnPlanTimedRuns times between events), keeps the fastest as graph.plans[0] and records each
// candidate's mean time. A candidate that fails to run is recorded as failed and skipped.
void choose_fastest(DeviceState& st, CachedPlan& plan, cudnnBackendDescriptor_t pack,
                    cudaStream_t stream) {  // under st.mu, the handle bound to stream
  CudnnPlanRecord& rec = st.log[plan.log_index];
  auto& cands = plan.graph.plans;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  KESTREL_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  int best = capture == cudaStreamCaptureStatusNone ? -1 : 0;  // under capture: untimed, the first kept
  std::string failures;
  if (best < 0) {
    EventPair ev;
    float best_ms = 0;
    for (size_t i = 0; i < cands.size(); ++i) {
      cudnnBackendDescriptor_t p = cands[i].plan->get();
      cudnnStatus_t status = cudnnBackendExecute(st.handle, p, pack);  // loads the engine's kernels
      KESTREL_CUDA_CHECK(cudaEventRecord(ev.start, stream));
      for (int r = 0; r < kCudnnPlanTimedRuns && status == CUDNN_STATUS_SUCCESS; ++r)
        status = cudnnBackendExecute(st.handle, p, pack);
      KESTREL_CUDA_CHECK(cudaEventRecord(ev.stop, stream));
      KESTREL_CUDA_CHECK(cudaEventSynchronize(ev.stop));
      if (status != CUDNN_STATUS_SUCCESS) {
        (void)cudaGetLastError();  // a failed launch of this candidate's kernels, not a later call's error
        rec.candidates[plan.log_slots[i]].ms = -2;
        failures += std::string(failures.empty() ? "" : "; ") + "engine " + std::to_string(cands[i].engine) + ": " +
                    cudnnGetErrorString(status);
        continue;
      }
      float ms = 0;
      KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, ev.start, ev.stop));
      ms /= kCudnnPlanTimedRuns;
      rec.candidates[plan.log_slots[i]].ms = ms;
      if (best < 0 || ms < best_ms) best = static_cast<int>(i), best_ms = ms;
    }
  }
  KESTREL_CHECK(best >= 0, "attention", "cuDNN: none of the ", cands.size(), " execution plans of the ",
                rec.backward ? "backward" : "forward", " graph ran (", failures, ")");
  if (best > 0) std::swap(cands[0], cands[best]);
  cands.resize(1);
  rec.chosen = plan.log_slots[best];
  plan.chosen = true;
}

void execute(DeviceState& st, int device, CachedPlan& plan, Call& c, void* workspace, int64_t external_before,
             cudaStream_t stream) {  // under st.mu
  cudnn::Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  const int64_t n = static_cast<int64_t>(c.uids.size());
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, c.uids.data(), "variant pack uids");
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, c.ptrs.data(), "variant pack pointers");
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace, "variant pack workspace");
  pack.finalize("variant pack finalize");
  KESTREL_CUDNN_CHECK(cudnnSetStream(st.handle, stream));
  if (!plan.chosen) choose_fastest(st, plan, pack.get(), stream);
  KESTREL_CUDNN_CHECK(cudnnBackendExecute(st.handle, plan.graph.plans[0].plan->get(), pack.get()));
  if (!plan.ran && external_before > 0) {  // a new plan's first run loaded its kernels: charge them
    plan.ran = true;
    st.external += std::max<int64_t>(0, cuda::refresh_external(device) - external_before);
  }
}

Tensor allocate_workspace(int64_t bytes, Device device) {
  TagScope tag(MemoryTag::Workspace);
  return Tensor::empty({bytes}, DType::U8, device);
}

// Scratch rows past the packed tokens: room for a kernel tile that reaches past the last document.
constexpr int64_t kScratchPadRows = 128;

}  // namespace

void cudnn_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& cq, const Tensor& ck, const kernels::AttentionParams& p) {
  const int device = cuda::current_device();
  DeviceState& st = device_state(device);
  std::lock_guard<std::mutex> lock(st.mu);
  Call c = make_call(q, k, cq, p, /*backward=*/false);
  int64_t external_before = 0;
  CachedPlan& plan = plan_for(st, device, c, &external_before);
  Carve w;
  const MetadataPieces m = carve_metadata(w, plan.workspace(), c.key.b);
  Tensor ws = allocate_workspace(w.bytes, q.device());
  auto* base = static_cast<uint8_t*>(ws.data_ptr());
  cudaStream_t stream = cuda::current_stream();
  add_metadata(c, base, m, cq, ck, stream);
  c.add(cudnn::kQ, q.data_ptr());
  c.add(cudnn::kK, k.data_ptr());
  c.add(cudnn::kV, v.data_ptr());
  c.add(cudnn::kO, out.data_ptr());
  c.add(cudnn::kStats, lse.data_ptr());
  execute(st, device, plan, c, base + m.plan, external_before, stream);
}

void cudnn_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                              const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                              const Tensor& cq, const Tensor& ck, const kernels::AttentionParams& p) {
  const int device = cuda::current_device();
  DeviceState& st = device_state(device);
  std::lock_guard<std::mutex> lock(st.mu);
  Call c = make_call(q, k, cq, p, /*backward=*/true);
  int64_t external_before = 0;
  CachedPlan& plan = plan_for(st, device, c, &external_before);
  const int64_t hq = c.key.hq, d = c.key.d;
  const int64_t rows_q = c.total_q + kScratchPadRows, rows_k = c.total_k + kScratchPadRows;
  const bool gqa = c.key.hq != c.key.hkv;
  Carve w;
  const MetadataPieces m = carve_metadata(w, plan.workspace(), c.key.b);
  const int64_t at_dq_accum = w.take(rows_q * hq * d * 4), at_softmax_sum = w.take(rows_q * hq * 4);
  // Full-head dK / dV: sized in f32 as cudnn-frontend sizes them, though they hold the io type.
  const int64_t at_dk_full = gqa ? w.take(rows_k * hq * d * 4) : 0, at_dv_full = gqa ? w.take(rows_k * hq * d * 4) : 0;
  Tensor ws = allocate_workspace(w.bytes, q.device());
  auto* base = static_cast<uint8_t*>(ws.data_ptr());
  cudaStream_t stream = cuda::current_stream();
  add_metadata(c, base, m, cq, ck, stream);
  c.add(cudnn::kQ, q.data_ptr());
  c.add(cudnn::kK, k.data_ptr());
  c.add(cudnn::kV, v.data_ptr());
  c.add(cudnn::kO, out.data_ptr());
  c.add(cudnn::kDO, dout.data_ptr());
  c.add(cudnn::kStats, lse.data_ptr());
  c.add(cudnn::kDQ, dq.data_ptr());
  c.add(cudnn::kDK, dk.data_ptr());
  c.add(cudnn::kDV, dv.data_ptr());
  c.add(cudnn::kOne, &c.one);
  c.add(cudnn::kDQAccum, base + at_dq_accum);  // cuDNN >= 9.6 clears it itself
  c.add(cudnn::kSoftmaxSum, base + at_softmax_sum);
  if (gqa) {
    c.add(cudnn::kDKFull, base + at_dk_full);
    c.add(cudnn::kDVFull, base + at_dv_full);
  }
  execute(st, device, plan, c, base + m.plan, external_before, stream);
}

int64_t cudnn_attention_external_bytes(int device) {
  DeviceState& st = device_state(device);
  std::lock_guard<std::mutex> lock(st.mu);
  return st.external;
}

std::vector<CudnnPlanRecord> cudnn_attention_plan_log(int device) {
  DeviceState& st = device_state(device);
  std::lock_guard<std::mutex> lock(st.mu);
  return st.log;
}

}  // namespace kestrel::cuda_ops

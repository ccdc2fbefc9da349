// A thin C++ layer over cuDNN's C backend API (cudnn_graph.h): RAII descriptors, 4-D tensor
// descriptors, the operations the SDPA graph pattern uses (matmul, pointwise, reduction, reshape),
// and turning an operation graph into candidate execution plans (the engine configs of heuristics
// CUDNN_HEUR_MODE_A, then CUDNN_HEUR_MODE_FALLBACK, that finalise; the caller picks one). No
// cudnn-frontend: the graphs in graphs.cpp are written against this.
#pragma once

#include <cudnn_graph.h>

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

namespace kestrel::cuda_ops::cudnn {

// Throws kestrel::Error "[attention] cuDNN: <what> failed: <status> (<cuDNN's last error>)".
void check(cudnnStatus_t status, const char* what);
#define KESTREL_CUDNN_CHECK(expr) ::kestrel::cuda_ops::cudnn::check((expr), #expr)

// One backend descriptor (cudnnBackendCreateDescriptor / DestroyDescriptor).
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type);
  ~Desc();
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count, const void* values,
           const char* what);
  void set_desc(cudnnBackendAttributeName_t name, const Desc& value, const char* what);
  void finalize(const char* what);
  cudnnStatus_t try_finalize();

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::array<int64_t, 4>;

// A tensor of the graph: its descriptor (finalised), uid, shape and type.
struct TensorRef {
  std::unique_ptr<Desc> desc;
  int64_t uid = 0;
  Dims dim{}, stride{};
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
};
using T = const TensorRef*;

// One finalised execution plan and what it runs.
struct PlanCandidate {
  std::unique_ptr<Desc> config, plan;
  int64_t workspace = 0;        // the plan's own workspace, bytes
  int64_t engine = -1;          // CUDNN_ATTR_ENGINE_GLOBAL_INDEX (-1: not readable)
  std::string knobs;            // the config's knob choices, "type=value" (cudnnBackendKnobType_t numbers)
  const char* heuristics = "";  // "A" or "fallback": the heuristics mode that proposed it
};

// Builds one operation graph. Tensors and operations live as long as the builder (an execution plan
// built from it keeps the builder alive too).
class GraphBuilder {
 public:
  // A non-virtual tensor with a caller-chosen uid (the variant pack's key); ragged: the offsets
  // tensor (i64 [B + 1, 1, 1, 1], elements) of a packed (THD) layout.
  T tensor(int64_t uid, Dims dim, Dims stride, cudnnDataType_t type, T ragged = nullptr);
  // A scalar passed by value at execution (f32 [1, 1, 1, 1]; the variant pack holds a host pointer).
  T scalar(int64_t uid);
  // An intermediate that never reaches memory (uid from the builder's own range).
  T virt(Dims dim, Dims stride, cudnnDataType_t type, T ragged = nullptr);

  // y = op(x [, b [, t]]): CUDNN_ATTR_OPERATION_POINTWISE_{X,B,T,Y}DESC; compute: the math precision;
  // axis: GEN_INDEX's dimension (ignored otherwise).
  T pointwise(cudnnPointwiseMode_t mode, T x, T b, T t, T y, cudnnDataType_t compute, int64_t axis = -1);
  // c = a @ b (batched over the first two dims, b's head dim broadcast over GQA groups); the
  // overrides are i32 [B, 1, 1, 1] per-batch m / n / k (nullptr = none); padding: the value of
  // score entries outside the overridden extents (fwd's Q K^T only).
  T matmul(T a, T b, T c, T m_override, T n_override, T k_override, bool pad_zero = false);
  T reduction(cudnnReduceTensorOp_t op, T x, T y);
  T reshape(T x, T y);

  // The operation graph over every operation added and up to max_plans execution plans that finalise:
  // the engine configs of heuristics mode A in their order, then, while fewer than max_plans, those
  // of mode FALLBACK not already taken (same engine and knobs). max_plans 1: the first config of mode
  // A that finalises (fallback only when none does). Throws, naming the graph and cuDNN's last
  // error, when no config finalises.
  std::vector<PlanCandidate> build_plans(cudnnHandle_t handle, const char* name, int max_plans);

 private:
  T add(int64_t uid, Dims dim, Dims stride, cudnnDataType_t type, bool is_virtual, bool by_value, T ragged);
  std::deque<TensorRef> tensors_;
  std::vector<std::unique_ptr<Desc>> ops_, aux_;
  std::unique_ptr<Desc> graph_;
  int64_t next_virtual_uid_ = 1000;
};

}  // namespace kestrel::cuda_ops::cudnn

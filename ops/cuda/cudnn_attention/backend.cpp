// cuDNN backend API helpers (backend.h). The handle attributes of the operation graph and the
// execution plan are deprecated in cuDNN 9 in favour of device-property descriptors but still the
// documented way to bind a graph to a handle; the warnings are silenced here, in one place.
#include "cuda/cudnn_attention/backend.h"

#include <cmath>
#include <limits>

#include "kestrel/runtime/error.h"

#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace kestrel::cuda_ops::cudnn {

void check(cudnnStatus_t status, const char* what) {
  if (status == CUDNN_STATUS_SUCCESS) return;
  char last[512] = {0};
  cudnnGetLastErrorString(last, sizeof last);
  throw make_error("attention", "cuDNN: ", what, " failed: ", cudnnGetErrorString(status), " (", last,
                   "); run with CUDNN_LOGERR_DBG=1 CUDNN_LOGDEST_DBG=stderr for cuDNN's log");
}

Desc::Desc(cudnnBackendDescriptorType_t type) {
  check(cudnnBackendCreateDescriptor(type, &d_), "cudnnBackendCreateDescriptor");
}
Desc::~Desc() {
  if (d_) cudnnBackendDestroyDescriptor(d_);
}
void Desc::set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count, const void* values,
               const char* what) {
  check(cudnnBackendSetAttribute(d_, name, type, count, values), what);
}
void Desc::set_desc(cudnnBackendAttributeName_t name, const Desc& value, const char* what) {
  cudnnBackendDescriptor_t v = value.get();
  set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &v, what);
}
void Desc::finalize(const char* what) { check(cudnnBackendFinalize(d_), what); }
cudnnStatus_t Desc::try_finalize() { return cudnnBackendFinalize(d_); }

T GraphBuilder::add(int64_t uid, Dims dim, Dims stride, cudnnDataType_t type, bool is_virtual, bool by_value,
                    T ragged) {
  TensorRef& t = tensors_.emplace_back();
  t.desc = std::make_unique<Desc>(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  t.uid = uid;
  t.dim = dim;
  t.stride = stride;
  t.type = type;
  Desc& d = *t.desc;
  const int64_t alignment = 16;
  d.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, "tensor data type");
  d.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dim.data(), "tensor dimensions");
  d.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, stride.data(), "tensor strides");
  d.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor uid");
  d.set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, "tensor alignment");
  d.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, "tensor is_virtual");
  if (by_value) d.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, "tensor is_by_value");
  if (ragged) d.set_desc(CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, *ragged->desc, "tensor ragged offset");
  d.finalize("tensor descriptor finalize");
  return &t;
}

T GraphBuilder::tensor(int64_t uid, Dims dim, Dims stride, cudnnDataType_t type, T ragged) {
  return add(uid, dim, stride, type, false, false, ragged);
}
T GraphBuilder::scalar(int64_t uid) { return add(uid, {1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_FLOAT, false, true, nullptr); }
T GraphBuilder::virt(Dims dim, Dims stride, cudnnDataType_t type, T ragged) {
  return add(next_virtual_uid_++, dim, stride, type, true, false, ragged);
}

T GraphBuilder::pointwise(cudnnPointwiseMode_t mode, T x, T b, T t, T y, cudnnDataType_t compute, int64_t axis) {
  auto pw = std::make_unique<Desc>(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
  pw->set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
  pw->set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &compute, "pointwise math precision");
  if (mode == CUDNN_POINTWISE_GEN_INDEX) pw->set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "pointwise axis");
  pw->finalize("pointwise descriptor finalize");
  auto op = std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
  op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, *pw, "pointwise op descriptor");
  op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, *x->desc, "pointwise x");
  if (b) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b->desc, "pointwise b");
  if (t) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *t->desc, "pointwise t");
  op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, *y->desc, "pointwise y");
  op->finalize("pointwise operation finalize");
  aux_.push_back(std::move(pw));
  ops_.push_back(std::move(op));
  return y;
}

T GraphBuilder::matmul(T a, T b, T c, T m_override, T n_override, T k_override, bool pad_zero) {
  auto mm = std::make_unique<Desc>(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
  const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
  mm->set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, "matmul compute type");
  if (pad_zero) {
    const double padding = 0.0;
    mm->set(CUDNN_ATTR_MATMUL_PADDING_VALUE, CUDNN_TYPE_DOUBLE, 1, &padding, "matmul padding value");
  }
  mm->finalize("matmul descriptor finalize");
  auto op = std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
  op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, *a->desc, "matmul a");
  op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, *b->desc, "matmul b");
  op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, *c->desc, "matmul c");
  op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, *mm, "matmul descriptor");
  if (m_override) op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, *m_override->desc, "matmul m override");
  if (n_override) op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, *n_override->desc, "matmul n override");
  if (k_override) op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, *k_override->desc, "matmul k override");
  op->finalize("matmul operation finalize");
  aux_.push_back(std::move(mm));
  ops_.push_back(std::move(op));
  return c;
}

T GraphBuilder::reduction(cudnnReduceTensorOp_t reduce, T x, T y) {
  auto red = std::make_unique<Desc>(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
  const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
  red->set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &reduce, "reduction operator");
  red->set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, "reduction compute type");
  red->finalize("reduction descriptor finalize");
  auto op = std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
  op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, *x->desc, "reduction x");
  op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, *y->desc, "reduction y");
  op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, *red, "reduction descriptor");
  op->finalize("reduction operation finalize");
  aux_.push_back(std::move(red));
  ops_.push_back(std::move(op));
  return y;
}

T GraphBuilder::reshape(T x, T y) {
  auto op = std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
  op->set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, *x->desc, "reshape x");
  op->set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, *y->desc, "reshape y");
  op->finalize("reshape operation finalize");
  ops_.push_back(std::move(op));
  return y;
}

std::unique_ptr<Desc> GraphBuilder::build_plan(cudnnHandle_t handle, const char* name, int64_t* workspace) {
  graph_ = std::make_unique<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  std::vector<cudnnBackendDescriptor_t> ops;
  for (const auto& op : ops_) ops.push_back(op->get());
  graph_->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops.size()),
              ops.data(), "operation graph ops");
  graph_->set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "operation graph handle");
  graph_->finalize(name);

  Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, *graph_, "heuristics graph");
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics mode");
  heur.finalize("engine heuristics finalize");
  int64_t count = 0;
  check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                 nullptr),
        "engine heuristics result count");
  KESTREL_CHECK(count > 0, "attention", "cuDNN: no engine for the ", name,
                " graph (run with CUDNN_LOGERR_DBG=1 CUDNN_LOGDEST_DBG=stderr for cuDNN's log)");
  std::vector<std::unique_ptr<Desc>> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    configs.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    raw.push_back(configs.back()->get());
  }
  int64_t got = 0;
  check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got,
                                 raw.data()),
        "engine heuristics results");
  cudnnStatus_t last = CUDNN_STATUS_NOT_SUPPORTED;
  for (int64_t i = 0; i < got; ++i) {
    auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "execution plan handle");
    plan->set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, *configs[i], "execution plan engine config");
    last = plan->try_finalize();
    if (last != CUDNN_STATUS_SUCCESS) continue;
    int64_t ws = 0, n = 0;
    check(cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &ws),
          "execution plan workspace size");
    *workspace = ws;
    for (auto& c : configs) aux_.push_back(std::move(c));
    return plan;
  }
  char msg[512] = {0};
  cudnnGetLastErrorString(msg, sizeof msg);
  throw make_error("attention", "cuDNN: none of the ", got, " engine configs of the ", name,
                   " graph finalised an execution plan (last status ", cudnnGetErrorString(last), ": ", msg,
                   "); run with CUDNN_LOGERR_DBG=1 CUDNN_LOGDEST_DBG=stderr for cuDNN's log");
}

}  // namespace kestrel::cuda_ops::cudnn

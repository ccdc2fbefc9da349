// cuDNN backend API helpers (backend.h). The handle attributes of the operation graph and the
// execution plan are deprecated in cuDNN 9 in favour of device-property descriptors but still the
// documented way to bind a graph to a handle; the warnings are silenced here, in one place.
#include "cuda/cudnn_attention/backend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

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

namespace {

// The engine configs heuristics `mode` proposes for `graph`, in its order; none where the
// heuristics do not finalise (FALLBACK may not cover a graph mode A does) and mode A was not asked.
std::vector<std::unique_ptr<Desc>> heuristic_configs(const Desc& graph, cudnnBackendHeurMode_t mode, const char* name) {
  Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph, "heuristics graph");
  heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics mode");
  std::vector<std::unique_ptr<Desc>> configs;
  if (mode == CUDNN_HEUR_MODE_A) heur.finalize("engine heuristics finalize");
  else if (heur.try_finalize() != CUDNN_STATUS_SUCCESS) return configs;
  int64_t count = 0;
  check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                 nullptr),
        "engine heuristics result count");
  if (count == 0) return configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    configs.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    raw.push_back(configs.back()->get());
  }
  int64_t got = 0;
  check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got,
                                 raw.data()),
        name);
  configs.resize(static_cast<size_t>(std::min(got, count)));
  return configs;
}

// The config's engine (CUDNN_ATTR_ENGINE_GLOBAL_INDEX) and knob choices, for the plan log; best
// effort (-1 / "?" where cuDNN does not say).
void describe_config(const Desc& config, PlanCandidate* c) {
  int64_t n = 0;
  Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  cudnnBackendDescriptor_t e = engine.get();
  if (cudnnBackendGetAttribute(config.get(), CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &e) ==
          CUDNN_STATUS_SUCCESS &&
      n == 1) {
    int64_t index = -1;
    if (cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &index) ==
        CUDNN_STATUS_SUCCESS)
      c->engine = index;
  }
  std::vector<std::unique_ptr<Desc>> choices;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int i = 0; i < CUDNN_KNOB_TYPE_COUNTS; ++i) {
    choices.push_back(std::make_unique<Desc>(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR));
    raw.push_back(choices.back()->get());
  }
  std::ostringstream knobs;
  if (cudnnBackendGetAttribute(config.get(), CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                               static_cast<int64_t>(raw.size()), &n, raw.data()) != CUDNN_STATUS_SUCCESS)
    n = -1;
  for (int64_t i = 0; i < n && i < static_cast<int64_t>(raw.size()); ++i) {
    cudnnBackendKnobType_t type{};
    int64_t value = 0, m = 0;
    if (i) knobs << ' ';
    if (cudnnBackendGetAttribute(raw[i], CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &m, &type) ==
            CUDNN_STATUS_SUCCESS &&
        cudnnBackendGetAttribute(raw[i], CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64, 1, &m, &value) ==
            CUDNN_STATUS_SUCCESS)
      knobs << static_cast<int>(type) << '=' << value;
    else
      knobs << '?';
  }
  c->knobs = n < 0 ? std::string("?") : knobs.str();
}

}  // namespace

std::vector<PlanCandidate> GraphBuilder::build_plans(cudnnHandle_t handle, const char* name, int max_plans) {
  graph_ = std::make_unique<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  std::vector<cudnnBackendDescriptor_t> ops;
  for (const auto& op : ops_) ops.push_back(op->get());
  graph_->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops.size()),
              ops.data(), "operation graph ops");
  graph_->set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "operation graph handle");
  graph_->finalize(name);

  std::vector<PlanCandidate> plans;
  int64_t tried = 0;
  cudnnStatus_t last = CUDNN_STATUS_NOT_SUPPORTED;
  for (const cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    if (static_cast<int>(plans.size()) >= max_plans) break;
    for (auto& config : heuristic_configs(*graph_, mode, "engine heuristics results")) {
      if (static_cast<int>(plans.size()) >= max_plans) break;
      PlanCandidate c;
      describe_config(*config, &c);
      const bool taken = std::any_of(plans.begin(), plans.end(), [&](const PlanCandidate& p) {
        return c.engine >= 0 && p.engine == c.engine && p.knobs == c.knobs;
      });
      if (taken) continue;
      ++tried;
      auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "execution plan handle");
      plan->set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, *config, "execution plan engine config");
      last = plan->try_finalize();
      if (last != CUDNN_STATUS_SUCCESS) continue;
      int64_t n = 0;
      check(cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n,
                                     &c.workspace),
            "execution plan workspace size");
      c.heuristics = mode == CUDNN_HEUR_MODE_A ? "A" : "fallback";
      c.config = std::move(config);
      c.plan = std::move(plan);
      plans.push_back(std::move(c));
    }
  }
  if (!plans.empty()) return plans;
  char msg[512] = {0};
  cudnnGetLastErrorString(msg, sizeof msg);
  throw make_error("attention", "cuDNN: none of the ", tried, " engine configs of the ", name,
                   " graph finalised an execution plan (last status ", cudnnGetErrorString(last), ": ", msg,
                   "); run with CUDNN_LOGERR_DBG=1 CUDNN_LOGDEST_DBG=stderr for cuDNN's log");
}

}  // namespace kestrel::cuda_ops::cudnn

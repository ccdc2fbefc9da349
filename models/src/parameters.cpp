// ParameterList bookkeeping and the Tensor-level safetensors load/save.
#include "kestrel/models/parameters.h"

#include <algorithm>
#include <set>

#include "kestrel/models/safetensors.h"
#include "kestrel/runtime/error.h"

namespace kestrel::models {

void ParameterList::add(const std::string& name, Tensor* t) {
  KESTREL_CHECK(t && t->defined(), "parameters", "parameter '", name, "' is undefined");
  KESTREL_CHECK(!index_.count(name), "parameters", "duplicate parameter name '", name, "'");
  index_[name] = items_.size();
  items_.emplace_back(name, t);
}

Tensor* ParameterList::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : items_[it->second].second;
}

Tensor& ParameterList::get(const std::string& name) const {
  Tensor* t = find(name);
  KESTREL_CHECK(t != nullptr, "parameters", "no parameter named '", name, "'");
  return *t;
}

int64_t ParameterList::numel() const {
  int64_t n = 0;
  for (auto& [name, t] : items_) n += t->numel();
  return n;
}

int64_t ParameterList::nbytes() const {
  int64_t n = 0;
  for (auto& [name, t] : items_) n += static_cast<int64_t>(t->nbytes());
  return n;
}

std::vector<Tensor> ParameterList::tensors() const {
  std::vector<Tensor> out;
  for (auto& [name, t] : items_) out.push_back(*t);
  return out;
}

void ParameterList::zero_grad() const {
  for (auto& [name, t] : items_) t->zero_grad();
}

Tensor make_parameter(const std::string& name, const Shape& shape, DType dtype, Device device) {
  TagScope tag(MemoryTag::Parameter);
  MemoryLabelScope label(name, /*nested=*/false);  // the profiler names parameters by their HF name
  Tensor t = Tensor::empty(shape, dtype, device);
  t.set_requires_grad(true).set_name(name);
  return t;
}

void init_normal(Tensor& t, double std, Generator& gen) {
  t.copy_(normal(t.shape(), 0.0, std, DType::F32, Device::cpu(), gen));
}

void init_constant(Tensor& t, double value) { t.fill_(value); }

LoadReport load_safetensors(const ParameterList& params, const std::string& path, bool strict) {
  SafetensorsReader reader = SafetensorsReader::open(path);
  LoadReport report;
  std::set<std::string> used;
  for (auto& [name, t] : params.items()) {
    const SafetensorsEntry* e = reader.find(name);
    if (!e) {
      report.missing.push_back(name);
      continue;
    }
    used.insert(name);
    Shape shape(e->shape.begin(), e->shape.end());
    KESTREL_CHECK(shape == t->shape(), "load", "tensor '", name, "' in ", e->file, " has shape ", shape_str(shape),
                  ", the model expects ", shape_str(t->shape()));
    Tensor src = Tensor::from_blob(const_cast<std::byte*>(e->bytes.data()), shape, e->dtype, Device::cpu());
    t->copy_(src);
  }
  for (const std::string& n : reader.names())
    if (!used.count(n)) report.unexpected.push_back(n);
  if (strict && !report.missing.empty()) {
    std::string list;
    for (size_t i = 0; i < report.missing.size() && i < 10; ++i) list += (i ? ", " : "") + report.missing[i];
    if (report.missing.size() > 10) list += ", ...";
    throw make_error("load", path, " is missing ", report.missing.size(), " parameter(s) the model needs: ", list);
  }
  return report;
}

void save_safetensors(const ParameterList& params, const std::string& dir,
                      const std::map<std::string, std::string>& metadata, uint64_t max_shard_bytes,
                      const std::string& base) {
  std::vector<Tensor> host;  // keeps the host copies alive while writing
  std::vector<SafetensorsWriteEntry> entries;
  host.reserve(params.size());
  for (auto& [name, t] : params.items()) {
    host.push_back(t->to(Device::cpu()).contiguous());
    const Tensor& h = host.back();
    entries.push_back({name, h.dtype(), Shape(h.shape()), h.data_ptr()});
  }
  std::map<std::string, std::string> meta = metadata;
  meta.emplace("format", "pt");
  write_safetensors_checkpoint(dir, entries, meta, max_shard_bytes, base);
}

}  // namespace kestrel::models

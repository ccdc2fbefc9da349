// ParameterList: a model's parameters under their Hugging Face names, in registration order,
// with safetensors load/save. A checkpoint written here loads in transformers 1:1 and back.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kestrel/runtime/random.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::models {

class ParameterList {
 public:
  // Registers `t` (owned by the model) under `name`; names must be unique.
  void add(const std::string& name, Tensor* t);
  const std::vector<std::pair<std::string, Tensor*>>& items() const { return items_; }
  Tensor* find(const std::string& name) const;
  Tensor& get(const std::string& name) const;  // throws naming the missing parameter
  int64_t numel() const;
  int64_t nbytes() const;
  size_t size() const { return items_.size(); }
  std::vector<Tensor> tensors() const;
  void zero_grad() const;

 private:
  std::vector<std::pair<std::string, Tensor*>> items_;
  std::map<std::string, size_t> index_;
};

// Allocates a parameter (tag Parameter) that requires grad and carries its name.
Tensor make_parameter(const std::string& name, const Shape& shape, DType dtype, Device device);
// HF-style initialisation: normal(0, std) for weights, ones for norm scales, zeros for biases.
void init_normal(Tensor& t, double std, Generator& gen);
void init_constant(Tensor& t, double value);

struct LoadReport {
  std::vector<std::string> missing;     // parameters not in the checkpoint
  std::vector<std::string> unexpected;  // checkpoint tensors that match no parameter
};

// Loads tensors by name from a .safetensors file, an index.json or a folder, converting dtypes to
// each parameter's dtype and copying to its device. Shape mismatches are errors naming the tensor.
// With `strict`, missing parameters are an error too (listed); unexpected tensors are reported.
LoadReport load_safetensors(const ParameterList& params, const std::string& path, bool strict = true);
// Writes all parameters (in their dtype, or `dtype` when given) as a checkpoint folder
// (model.safetensors, or shards + index above max_shard_bytes), atomically.
void save_safetensors(const ParameterList& params, const std::string& dir,
                      const std::map<std::string, std::string>& metadata = {}, uint64_t max_shard_bytes = uint64_t{5} << 30,
                      const std::string& base = "model");

}  // namespace kestrel::models

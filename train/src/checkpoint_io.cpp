#include "checkpoint_io.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "kestrel/models/config.h"
#include "kestrel/models/file_io.h"
#include "kestrel/models/safetensors.h"
#include "kestrel/runtime/error.h"

namespace kestrel::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {
std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

std::vector<fs::path> complete_checkpoints(const std::string& out_dir) {
  std::vector<fs::path> out;
  fs::path root = fs::path(out_dir) / "checkpoints";
  if (!fs::exists(root)) return out;
  for (auto& e : fs::directory_iterator(root)) {
    std::string n = e.path().filename().string();
    if (e.is_directory() && n.rfind("step_", 0) == 0 && fs::exists(e.path() / "trainer_state.json")) out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}
}  // namespace

std::string save_checkpoint(const std::string& out_dir, int64_t step, uint64_t data_position,
                            const models::ParameterList& params, const AdamW& optim, const json& config,
                            int64_t keep) {
  fs::path root = fs::path(out_dir) / "checkpoints";
  fs::create_directories(root);
  fs::path final_dir = root / step_name(step);
  fs::path tmp = root / ("." + step_name(step) + ".tmp");
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  models::save_safetensors(params, tmp.string());
  // Optimizer state.
  std::vector<std::pair<std::string, Tensor>> state = optim.state();
  std::vector<Tensor> host;
  std::vector<models::SafetensorsWriteEntry> entries;
  host.reserve(state.size());
  for (auto& [name, t] : state) {
    host.push_back(t.to(Device::cpu()).contiguous());
    entries.push_back({name, host.back().dtype(), host.back().shape(), host.back().data_ptr()});
  }
  models::write_safetensors((tmp / "optimizer.safetensors").string(), entries);
  json st{{"step", step}, {"data_position", data_position}, {"optimizer_steps", optim.steps()}, {"config", config}};
  models::write_json_file((tmp / "trainer_state.json").string(), st, "checkpoint");
  models::fsync_directory(tmp.string(), "checkpoint");
  // An existing folder of the same step (a re-run) is replaced only now that the new one is complete.
  if (fs::exists(final_dir)) fs::remove_all(final_dir);
  fs::rename(tmp, final_dir);
  models::fsync_directory(root.string(), "checkpoint");
  if (keep > 0) {
    auto all = complete_checkpoints(out_dir);
    for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) fs::remove_all(all[i]);
  }
  return final_dir.string();
}

CheckpointState load_checkpoint(const std::string& dir, const models::ParameterList& params, AdamW& optim) {
  KESTREL_CHECK(fs::exists(fs::path(dir) / "trainer_state.json"), "checkpoint", dir,
                " is not a complete checkpoint (no trainer_state.json)");
  json st = models::read_json_file((fs::path(dir) / "trainer_state.json").string(), "checkpoint");
  models::load_safetensors(params, dir, /*strict=*/true);
  models::SafetensorsReader r = models::SafetensorsReader::open((fs::path(dir) / "optimizer.safetensors").string());
  std::map<std::string, Tensor> tensors;
  for (const std::string& n : r.names()) {
    const models::SafetensorsEntry& e = r.get(n);
    tensors[n] = Tensor::from_blob(const_cast<std::byte*>(e.bytes.data()), Shape(e.shape.begin(), e.shape.end()),
                                   e.dtype, Device::cpu());
  }
  optim.load_state(tensors, st.at("optimizer_steps").get<int64_t>());
  CheckpointState cs;
  cs.step = st.at("step").get<int64_t>();
  if (st.contains("data_position")) cs.data_position = st["data_position"].get<int64_t>();
  return cs;
}

std::string latest_checkpoint(const std::string& out_dir) {
  auto all = complete_checkpoints(out_dir);
  return all.empty() ? std::string() : all.back().string();
}

}  // namespace kestrel::train

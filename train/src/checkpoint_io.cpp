// Trainer checkpoints: writing (space check, temp folder, manifest, rename into place, pruning),
// finding the newest intact one, loading, and cleaning what a killed run left. The manifest, its
// verification and the config comparison live in checkpoint_manifest.cpp. The policy is stated in
// checkpoint_io.h.
#include "checkpoint_io.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <optional>
#include <vector>

#include "checkpoint_manifest.h"
#include "kestrel/models/config.h"
#include "kestrel/models/file_io.h"
#include "kestrel/models/safetensors.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory_budget.h"

namespace kestrel::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Free space kept beyond the checkpoint's own bytes: other writers (logs, metrics) and the
// filesystem's own slack should not be left with nothing.
constexpr uint64_t kSpaceMarginBytes = uint64_t{64} << 20;

std::mutex g_space_mutex;
std::function<uint64_t(const std::string&)> g_space_override;

uint64_t available_space(const fs::path& dir) {
  {
    std::lock_guard<std::mutex> lock(g_space_mutex);
    if (g_space_override) return g_space_override(dir.string());
  }
  return fs::space(dir).available;
}

// Hidden names: never taken for checkpoints, cleaned at the next start.
fs::path hidden(const fs::path& root, const std::string& name, const char* suffix) {
  return root / ("." + name + suffix);
}

// Renames `dir` to a hidden name, makes the rename durable, then deletes it: a kill in between
// leaves a hidden folder (cleaned at the next start), never a half-deleted step folder.
void remove_by_rename(const fs::path& root, const fs::path& dir) {
  fs::path gone = hidden(root, dir.filename().string(), ".deleting");
  fs::remove_all(gone);
  fs::rename(dir, gone);
  models::fsync_directory(root.string(), "checkpoint");
  fs::remove_all(gone);
}

void check_space(const fs::path& root, int64_t step, const models::ParameterList& params, const AdamW& optim,
                 OptimizerStateForm form, int shards = 1) {
  // Sharded state: the other ranks' shards are about the size of this one (ownership is balanced).
  const uint64_t need = checkpoint_bytes(params, optim, form) +
                        (checkpoint_bytes(params, optim, form) - checkpoint_bytes(params, optim, OptimizerStateForm::None)) *
                            static_cast<uint64_t>(shards - 1);
  const uint64_t margin = kSpaceMarginBytes + need / 100;
  const uint64_t avail = available_space(root);
  if (avail >= need + margin) return;
  std::vector<std::string> existing = checkpoint_folders(root.parent_path().string());
  std::string smaller;
  if (form == OptimizerStateForm::Full)
    smaller += "checkpoint_optimizer_state=\"bf16\" (about " +
               format_bytes(static_cast<int64_t>(checkpoint_bytes(params, optim, OptimizerStateForm::Bf16))) +
               ", resume not bit-exact), ";
  if (form != OptimizerStateForm::None)
    smaller += "checkpoint_optimizer_state=\"none\" (about " +
               format_bytes(static_cast<int64_t>(checkpoint_bytes(params, optim, OptimizerStateForm::None))) +
               ", resume restarts the optimizer state), ";
  throw make_error("checkpoint", "not enough disk space for the checkpoint of step ", step, ": it needs about ",
                   format_bytes(static_cast<int64_t>(need)), " (checkpoint_optimizer_state=\"",
                   optimizer_state_form_name(form), "\") plus a margin of ",
                   format_bytes(static_cast<int64_t>(margin)), ", and ", root.string(), " has ",
                   format_bytes(static_cast<int64_t>(avail)), " available. Nothing was written; ",
                   existing.empty() ? std::string("there is no earlier checkpoint")
                                    : "the previous checkpoint " + existing.back() + " is untouched",
                   ". Smaller forms: ", smaller, "or free space, lower keep_checkpoints, or choose another out_dir");
}

void write_optimizer_state(const fs::path& path, const AdamW& optim, OptimizerStateForm form) {
  std::vector<std::pair<std::string, Tensor>> state = optim.state();
  std::vector<Tensor> host;
  std::vector<models::SafetensorsWriteEntry> entries;
  host.reserve(state.size());
  for (auto& [name, t] : state) {
    Tensor h = t.to(Device::cpu()).contiguous();
    // Only f32 state shrinks; 8-bit codes (optimizer.state_dtype "q8") and bf16 stay as they are.
    if (form == OptimizerStateForm::Bf16 && h.dtype() == DType::F32) h = h.to(DType::BF16);
    host.push_back(h);
    entries.push_back({name, host.back().dtype(), host.back().shape(), host.back().data_ptr()});
  }
  models::write_safetensors(path.string(), entries);
}

constexpr const char* kFp8StateFile = "fp8_state.safetensors";

void write_fp8_state(const fs::path& path, const Fp8State& fp8) {
  Tensor history = fp8.history().to(Device::cpu()).contiguous(), scale = fp8.scale().to(Device::cpu()).contiguous();
  Tensor rolls = Tensor::from_vector(std::vector<int64_t>{fp8.rolls()}, {1}, DType::I64);
  models::write_safetensors(path.string(), {{"history", history.dtype(), history.shape(), history.data_ptr()},
                                            {"scale", scale.dtype(), scale.shape(), scale.data_ptr()},
                                            {"rolls", rolls.dtype(), rolls.shape(), rolls.data_ptr()}});
}

// Renames tmp to final_dir; an existing final_dir (a re-run of the same step) is first renamed to
// a hidden name and deleted only after the new folder is in place.
void put_in_place(const fs::path& root, const fs::path& tmp, const fs::path& final_dir) {
  if (!fs::exists(final_dir)) {
    fs::rename(tmp, final_dir);
    models::fsync_directory(root.string(), "checkpoint");
    return;
  }
  fs::path old = hidden(root, final_dir.filename().string(), ".old");
  fs::remove_all(old);
  fs::rename(final_dir, old);
  fs::rename(tmp, final_dir);
  models::fsync_directory(root.string(), "checkpoint");
  fs::remove_all(old);
}

void prune(const fs::path& root, int64_t keep, const fs::path& just_written) {
  if (keep <= 0) return;
  // Folders with a manifest are the ones that count; others are skipped by `latest` and left alone.
  std::vector<fs::path> complete;
  for (const std::string& d : checkpoint_folders(root.parent_path().string()))
    if (fs::exists(fs::path(d) / "manifest.json")) complete.emplace_back(d);
  for (size_t i = 0; i + static_cast<size_t>(keep) < complete.size(); ++i)
    if (complete[i] != just_written) remove_by_rename(root, complete[i]);
}

}  // namespace

OptimizerStateForm parse_optimizer_state_form(const std::string& s) {
  if (s == "full") return OptimizerStateForm::Full;
  if (s == "bf16") return OptimizerStateForm::Bf16;
  if (s == "none") return OptimizerStateForm::None;
  throw make_error("checkpoint", "checkpoint_optimizer_state must be \"full\", \"bf16\" or \"none\", got '", s, "'");
}

const char* optimizer_state_form_name(OptimizerStateForm f) {
  switch (f) {
    case OptimizerStateForm::Full: return "full";
    case OptimizerStateForm::Bf16: return "bf16";
    case OptimizerStateForm::None: return "none";
  }
  return "?";
}

uint64_t checkpoint_bytes(const models::ParameterList& params, const AdamW& optim, OptimizerStateForm form) {
  uint64_t bytes = static_cast<uint64_t>(params.nbytes()) + 256 * params.size();
  if (form != OptimizerStateForm::None) {
    for (auto& [name, t] : optim.state()) {
      bytes += 256 + (form == OptimizerStateForm::Bf16 && t.dtype() == DType::F32 ? static_cast<uint64_t>(t.numel()) * 2
                                                                                : t.nbytes());
    }
  }
  return bytes + (uint64_t{1} << 20);  // trainer_state.json (the config), manifest, index
}

std::string optimizer_shard_name(int rank, int world) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "optimizer-%05d-of-%05d.safetensors", rank, world);
  return buf;
}

namespace {
// The ZeRO form of save_checkpoint (checkpoint_io.h): three phases separated by barriers.
std::string save_checkpoint_sharded(const std::string& out_dir, int64_t step, uint64_t data_position,
                                    const models::ParameterList& params, const AdamW& optim, const json& config,
                                    int64_t keep, OptimizerStateForm form, Communicator& comm, const Fp8State* fp8) {
  const fs::path root = fs::path(out_dir) / "checkpoints";
  const std::string name = checkpoint_step_name(step);
  const fs::path final_dir = root / name, tmp = hidden(root, name, ".tmp");
  const bool writer = comm.rank() == 0;
  try {
    try {
      if (writer) {
        fs::create_directories(root);
        check_space(root, step, params, optim, form, comm.world_size());
        fs::remove_all(tmp);
        fs::create_directories(tmp);
        models::save_safetensors(params, tmp.string());
        if (fp8) write_fp8_state(tmp / kFp8StateFile, *fp8);
      }
      comm.barrier();  // the folder exists
      if (form != OptimizerStateForm::None)
        write_optimizer_state(tmp / optimizer_shard_name(comm.rank(), comm.world_size()), optim, form);
      comm.barrier();  // every shard is written
      if (writer) {
        json st{{"step", step},
                {"data_position", data_position},
                {"optimizer_steps", optim.steps()},
                {"optimizer_state", optimizer_state_form_name(form)},
                {"config", config}};
        models::write_json_file((tmp / "trainer_state.json").string(), st, "checkpoint");
        write_checkpoint_manifest(tmp.string(), step, data_position, optimizer_state_form_name(form));
        models::fsync_directory(tmp.string(), "checkpoint");
      }
    } catch (const std::exception& e) {
      comm.abort(e.what());  // the other ranks fail at the next barrier with this message
      throw;
    }
  } catch (...) {
    std::error_code ec;
    if (writer) fs::remove_all(tmp, ec);
    throw;
  }
  if (writer) {
    try {
      put_in_place(root, tmp, final_dir);
      prune(root, keep, final_dir);
    } catch (const std::exception& e) {
      comm.abort(e.what());  // the others are past the last barrier: fail them now, not at a timeout
      throw;
    }
  }
  return final_dir.string();
}
}  // namespace

std::string save_checkpoint(const std::string& out_dir, int64_t step, uint64_t data_position,
                            const models::ParameterList& params, const AdamW& optim, const json& config,
                            int64_t keep, OptimizerStateForm form, Communicator* shards, const Fp8State* fp8) {
  if (shards)
    return save_checkpoint_sharded(out_dir, step, data_position, params, optim, config, keep, form, *shards, fp8);
  fs::path root = fs::path(out_dir) / "checkpoints";
  fs::create_directories(root);
  check_space(root, step, params, optim, form);
  const std::string name = checkpoint_step_name(step);
  fs::path final_dir = root / name;
  fs::path tmp = hidden(root, name, ".tmp");
  try {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
    models::save_safetensors(params, tmp.string());
    if (form != OptimizerStateForm::None) write_optimizer_state(tmp / "optimizer.safetensors", optim, form);
    if (fp8) write_fp8_state(tmp / kFp8StateFile, *fp8);
    json st{{"step", step},
            {"data_position", data_position},
            {"optimizer_steps", optim.steps()},
            {"optimizer_state", optimizer_state_form_name(form)},
            {"config", config}};
    models::write_json_file((tmp / "trainer_state.json").string(), st, "checkpoint");
    write_checkpoint_manifest(tmp.string(), step, data_position, optimizer_state_form_name(form));
    models::fsync_directory(tmp.string(), "checkpoint");
  } catch (...) {
    std::error_code ec;
    fs::remove_all(tmp, ec);  // a failed write (disk full after all) leaves nothing behind
    throw;
  }
  put_in_place(root, tmp, final_dir);
  prune(root, keep, final_dir);
  return final_dir.string();
}

CheckpointState read_checkpoint_state(const std::string& dir) {
  json st = models::read_json_file((fs::path(dir) / "trainer_state.json").string(), "checkpoint");
  CheckpointState cs;
  try {
    cs.step = st.at("step").get<int64_t>();
    cs.data_position = st.at("data_position").get<int64_t>();
    cs.optimizer_steps = st.at("optimizer_steps").get<int64_t>();
    cs.optimizer_state = parse_optimizer_state_form(st.value("optimizer_state", std::string("full")));
    cs.config = st.value("config", json::object());
  } catch (const json::exception& e) {
    throw make_error("checkpoint", dir, "/trainer_state.json: ", e.what());
  }
  return cs;
}

void load_checkpoint(const std::string& dir, const CheckpointState& cs, const models::ParameterList& params,
                     AdamW& optim) {
  models::load_safetensors(params, dir, /*strict=*/true);
  // The optimizer's own tensors say which names, shapes and dtypes load_state expects.
  std::map<std::string, Tensor> tensors;
  if (cs.optimizer_state == OptimizerStateForm::None) {
    for (auto& [name, t] : optim.state()) {
      const Tensor* p = name.rfind("master.", 0) == 0 ? params.find(name.substr(7)) : nullptr;
      tensors[name] = p ? p->to(Device::cpu()).to(t.dtype()) : Tensor::zeros(t.shape(), t.dtype(), Device::cpu());
    }
    optim.load_state(tensors, 0);
    return;
  }
  // optimizer.safetensors, or the ZeRO shards (any number: the names say which parameter each
  // tensor belongs to, so this rank takes what its AdamW holds wherever it was written).
  std::vector<fs::path> files;
  if (fs::exists(fs::path(dir) / "optimizer.safetensors")) {
    files.push_back(fs::path(dir) / "optimizer.safetensors");
  } else {
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().filename().string().rfind("optimizer-", 0) == 0) files.push_back(e.path());
    std::sort(files.begin(), files.end());
  }
  std::map<std::string, DType> want;
  for (auto& [name, t] : optim.state()) want[name] = t.dtype();
  std::vector<models::SafetensorsReader> readers;  // the mapped files outlive the tensors viewing them
  readers.reserve(files.size());
  for (const fs::path& f : files) {
    readers.push_back(models::SafetensorsReader::open(f.string()));
    const models::SafetensorsReader& r = readers.back();
    for (const std::string& n : r.names()) {
      auto it = want.find(n);
      if (it == want.end()) continue;  // another rank's shard
      const models::SafetensorsEntry& e = r.get(n);
      Tensor t = Tensor::from_blob(const_cast<std::byte*>(e.bytes.data()), Shape(e.shape.begin(), e.shape.end()),
                                   e.dtype, Device::cpu());
      tensors[n] = it->second != t.dtype() ? t.to(it->second) : t;
    }
  }
  optim.load_state(tensors, cs.optimizer_steps);
}

bool load_fp8_state(const std::string& dir, Fp8State& fp8) {
  const fs::path path = fs::path(dir) / kFp8StateFile;
  if (!fs::exists(path)) return false;
  models::SafetensorsReader r = models::SafetensorsReader::open(path.string());
  auto get = [&](const char* name) {
    const std::vector<std::string> names = r.names();
    KESTREL_CHECK(std::find(names.begin(), names.end(), name) != names.end(), "checkpoint", path.string(),
                  " has no tensor '", name, "'");
    const models::SafetensorsEntry& e = r.get(name);
    return Tensor::from_blob(const_cast<std::byte*>(e.bytes.data()), Shape(e.shape.begin(), e.shape.end()), e.dtype,
                             Device::cpu());
  };
  const Tensor rolls = get("rolls");
  KESTREL_CHECK(rolls.dtype() == DType::I64 && rolls.numel() == 1, "checkpoint", path.string(),
                ": 'rolls' must be i64 [1], got ", rolls.str());
  try {
    fp8.load(get("history"), get("scale"), rolls.data<int64_t>()[0]);
  } catch (const Error& e) {
    throw make_error("checkpoint", path.string(), " does not fit this model's FP8 linears (", fp8.linears(),
                     ", amax_history ", fp8.recipe().amax_history, "): ", e.what());
  }
  return true;
}

std::vector<std::string> checkpoint_folders(const std::string& out_dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  fs::path root = fs::path(out_dir) / "checkpoints";
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return {};
  for (auto& e : fs::directory_iterator(root)) {
    std::optional<int64_t> step = parse_checkpoint_step_name(e.path().filename().string());
    if (step && e.is_directory()) found.emplace_back(*step, e.path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [s, d] : found) out.push_back(d);
  return out;
}

std::string latest_checkpoint(const std::string& out_dir, std::vector<SkippedCheckpoint>* skipped) {
  std::vector<std::string> all = checkpoint_folders(out_dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    std::string problem = verify_checkpoint(*it);
    if (problem.empty()) return *it;
    if (skipped) skipped->push_back({*it, problem});
  }
  return "";
}

std::vector<std::string> clean_checkpoint_leftovers(const std::string& out_dir) {
  std::vector<std::string> done;
  fs::path root = fs::path(out_dir) / "checkpoints";
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return done;
  std::vector<fs::path> leftovers;
  for (auto& e : fs::directory_iterator(root))
    if (e.path().filename().string().rfind(".step_", 0) == 0) leftovers.push_back(e.path());
  for (const fs::path& p : leftovers) {
    const std::string n = p.filename().string();
    const size_t dot = n.find('.', 1);
    const std::string step = n.substr(1, dot == std::string::npos ? std::string::npos : dot - 1);
    if (n.size() > 4 && n.ends_with(".old") && parse_checkpoint_step_name(step) && !fs::exists(root / step)) {
      fs::rename(p, root / step);
      done.push_back("restored " + (root / step).string() + " (its replacement was interrupted)");
    } else {
      fs::remove_all(p);
      done.push_back("removed " + p.string() + " (left by an interrupted checkpoint write or deletion)");
    }
  }
  if (!leftovers.empty()) models::fsync_directory(root.string(), "checkpoint");
  return done;
}

std::vector<std::string> discard_checkpoints(const std::string& out_dir) {
  clean_checkpoint_leftovers(out_dir);
  std::vector<std::string> all = checkpoint_folders(out_dir);
  fs::path root = fs::path(out_dir) / "checkpoints";
  for (const std::string& d : all) remove_by_rename(root, d);
  return all;
}

void set_available_space_override(std::function<uint64_t(const std::string&)> f) {
  std::lock_guard<std::mutex> lock(g_space_mutex);
  g_space_override = std::move(f);
}

}  // namespace kestrel::train

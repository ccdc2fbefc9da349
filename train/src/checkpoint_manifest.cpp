// Checkpoint manifests (manifest.json: format, step, data position, optimizer-state form, and the
// size and XXH64 of every other file of the folder), their verification before a checkpoint is
// trusted, and the comparison of a checkpoint's config with the run that resumes from it.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>

#include "checkpoint_io.h"
#include "checkpoint_manifest.h"
#include "kestrel/models/config.h"
#include "kestrel/models/file_io.h"
#include "kestrel/runtime/error.h"
#include "kestrel/train/train_config.h"
#include "xxhash64.h"

namespace kestrel::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kManifestFormat = "kestrel.checkpoint/1";

struct FileDigest {
  uint64_t bytes = 0;
  std::string xxh64;
};

FileDigest digest(const fs::path& p) {
  auto f = models::MappedFile::open(p.string(), "checkpoint");
  return {f->size(), xxhash64_hex(xxhash64(f->data(), f->size()))};
}

// A file name inside the checkpoint folder: no separators, no "..", not hidden.
bool plain_name(const std::string& n) {
  return !n.empty() && n[0] != '.' && n.find('/') == std::string::npos && n.find('\\') == std::string::npos;
}

std::string verify_or_throw(const fs::path& dir) {
  const fs::path mpath = dir / "manifest.json";
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return "not a folder";
  if (!fs::exists(mpath, ec)) return "no manifest.json (an interrupted write, or a checkpoint from before manifests)";
  json m = models::read_json_file(mpath.string(), "checkpoint");
  if (m.value("format", std::string()) != kManifestFormat)
    return "manifest.json: format is not " + std::string(kManifestFormat);
  const json& files = m.at("files");
  if (!files.is_object()) return "manifest.json: 'files' is not an object";
  // Every listed file: a regular file of the stated size and checksum.
  for (auto it = files.begin(); it != files.end(); ++it) {
    const std::string& n = it.key();
    if (!plain_name(n)) return "manifest.json lists '" + n + "', which is not a plain file name";
    const fs::path p = dir / n;
    fs::file_status s = fs::symlink_status(p, ec);
    if (!fs::exists(s)) return n + " is missing";
    if (!fs::is_regular_file(s)) return n + " is not a regular file";
    const uint64_t want_bytes = it.value().at("bytes").get<uint64_t>();
    const uint64_t have_bytes = fs::file_size(p);
    if (have_bytes != want_bytes)
      return n + " has " + std::to_string(have_bytes) + " bytes, the manifest says " + std::to_string(want_bytes);
    const std::string want = it.value().at("xxh64").get<std::string>(), have = digest(p).xxh64;
    if (have != want)
      return n + " does not match its checksum (xxh64 " + have + ", the manifest says " + want +
             "): the file changed after it was written";
  }
  // Nothing else in the folder: an extra shard or state file would be read by the loaders.
  for (auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n != "manifest.json" && !files.contains(n)) return n + " is not in the manifest";
  }
  const std::string form = m.at("optimizer_state").get<std::string>();
  if (!files.contains("trainer_state.json")) return "trainer_state.json is not in the manifest";
  if (form != "none" && !files.contains("optimizer.safetensors")) {
    // ZeRO: optimizer-RRRRR-of-WWWWW.safetensors, all W of them and nothing else.
    int world = 0, found = 0;
    for (auto it = files.begin(); it != files.end(); ++it) {
      int r = -1, w = -1;
      char tail[32] = {0};
      if (std::sscanf(it.key().c_str(), "optimizer-%5d-of-%5d.%31s", &r, &w, tail) != 3) continue;
      // Only the canonical spelling counts (one name per rank), so `found` counts distinct ranks.
      char canon[64];
      std::snprintf(canon, sizeof canon, "optimizer-%05d-of-%05d.safetensors", r, w);
      if (std::string(tail) != "safetensors" || w < 1 || r < 0 || r >= w || (world != 0 && w != world) ||
          it.key() != canon)
        return "manifest.json lists '" + it.key() + "', which is not a shard of one optimizer-*-of-* set";
      world = w;
      ++found;
    }
    if (world == 0) return "neither optimizer.safetensors nor optimizer shards are in the manifest";
    if (found != world)
      return "the manifest lists " + std::to_string(found) + " of the " + std::to_string(world) + " optimizer shards";
  }
  if (!files.contains("model.safetensors") && !files.contains("model.safetensors.index.json"))
    return "neither model.safetensors nor model.safetensors.index.json is in the manifest";
  if (files.contains("model.safetensors.index.json")) {
    json idx = models::read_json_file((dir / "model.safetensors.index.json").string(), "checkpoint");
    for (auto& [tensor, file] : idx.at("weight_map").items()) {
      const std::string f = file.get<std::string>();
      if (!plain_name(f) || !files.contains(f))
        return "model.safetensors.index.json maps " + tensor + " to '" + f + "', which is not a file of this checkpoint";
    }
  }
  // Step and data position: folder name, manifest and trainer_state.json agree.
  json st = models::read_json_file((dir / "trainer_state.json").string(), "checkpoint");
  const int64_t step = st.at("step").get<int64_t>(), pos = st.at("data_position").get<int64_t>();
  if (m.at("step").get<int64_t>() != step)
    return "trainer_state.json says step " + std::to_string(step) + ", the manifest " + m.at("step").dump();
  if (m.at("data_position").get<int64_t>() != pos)
    return "trainer_state.json says data position " + std::to_string(pos) + ", the manifest " +
           m.at("data_position").dump();
  if (std::optional<int64_t> named = parse_checkpoint_step_name(dir.filename().string()); named && *named != step)
    return "the folder is named for step " + std::to_string(*named) + " but holds step " + std::to_string(step);
  if (st.contains("config") && st["config"].contains("train")) {
    const int64_t accum = st["config"]["train"].value("grad_accum", int64_t{1});
    if (pos != step * accum)
      return "data position " + std::to_string(pos) + " is not step " + std::to_string(step) + " x grad_accum " +
             std::to_string(accum);
  }
  if (st.value("optimizer_state", std::string("full")) != form)
    return "trainer_state.json and the manifest disagree on the optimizer-state form";
  return "";
}

// Settings that do not change the run's maths or data: they may differ on resume.
bool not_compared(const std::string& key) {
  static const std::set<std::string> keys = {
      "train.steps", "log_every", "eval_every", "sample_every", "sample_count", "checkpoint_every",
      "keep_checkpoints", "checkpoint_optimizer_state", "out_dir", "device", "recompute", "memory_budget",
      // The MLP's token tile: the same maths, its weight gradients summed in another order.
      "mlp_tile_tokens",
      // Fixed-order instead of atomic sums: the same maths (a diverging run's checkpoint may be
      // resumed deterministically to reproduce what follows).
      "train.deterministic",
      "threads", "prefetch", "prefetch_threads", "on_cpu", "on_cuda", "model.init_from", "data.eval_offset",
      "data.eval_samples", "data.eval_files", "train.nonfinite",
      // Where the AdamW state lives: the update is bit-identical either way.
      "optimizer.offload", "optimizer.staging_slot_mib", "optimizer.staging_slots",
      // Where the gradients wait for the update (the same values; the norm is summed on the host).
      "optimizer.gradients",
      // The host update beside the next forward: the same update, each layer waiting for its
      // parameters (bit for bit the update before the forward).
      "optimizer.update_overlap",
      // A diagnostic: one step's device time per op.
      "profile_step",
      // Which kernel writes the FP8 input casts (the producers or linear_fp8): the same bits.
      "fp8.fused_casts",
      // Where bytes live (memory.matmul_tf32 changes f32 GEMMs, so it is compared).
      "memory.pinned_limit", "memory.offload_inflight", "memory.allocator",
      // How the ranks share the work (the world size is not in the config either): ZeRO stages give
      // stage 0's update (stage 2's clip norm summed in another order), buckets the same means.
      "distributed"};
  for (std::string k = key;;) {
    if (keys.count(k)) return true;
    size_t dot = k.rfind('.');
    if (dot == std::string::npos) return false;
    k.resize(dot);
  }
}

// A key the saved config lacks (it was made before the key existed) that now holds its default
// value changes nothing.
bool added_at_default(const json& saved, const json& now, const std::string& path) {
  if (!saved.is_null() || path.empty()) return false;
  static const json defaults = default_train_config();
  const json* d = &defaults;
  for (size_t begin = 0; begin <= path.size();) {  // dotted path: no JSON-pointer escapes to get wrong
    const size_t end = std::min(path.find('.', begin), path.size());
    const std::string key = path.substr(begin, end - begin);
    if (!d->is_object() || !d->contains(key)) return false;
    d = &(*d)[key];
    begin = end + 1;
  }
  return *d == now;
}

// Keys added with a default that is not what runs did before them: a saved config without the key
// ran the old behaviour, so it is compared as that value (not skipped as "added at its default").
const json* behaviour_before_key(const std::string& path) {
  // Before train.weight_decay_params (issue 24) every parameter decayed; the default is "matrices".
  static const std::map<std::string, json> before = {{"train.weight_decay_params", "all"}};
  auto it = before.find(path);
  return it == before.end() ? nullptr : &it->second;
}

void diff(const json& saved_in, const json& now, const std::string& path, std::vector<std::string>& out) {
  const json* old = saved_in.is_null() ? behaviour_before_key(path) : nullptr;
  const json& saved = old ? *old : saved_in;
  if (!path.empty() && (not_compared(path) || added_at_default(saved, now, path))) return;
  if (saved.is_object() && now.is_object()) {
    std::set<std::string> keys;
    for (auto it = saved.begin(); it != saved.end(); ++it) keys.insert(it.key());
    for (auto it = now.begin(); it != now.end(); ++it) keys.insert(it.key());
    for (const std::string& k : keys) {
      const std::string sub = path.empty() ? k : path + "." + k;
      diff(saved.contains(k) ? saved[k] : json(), now.contains(k) ? now[k] : json(), sub, out);
    }
    return;
  }
  if (saved != now)
    out.push_back(path + ": saved " + (saved.is_null() ? "(absent)" : saved.dump()) + ", now " +
                  (now.is_null() ? "(absent)" : now.dump()));
}

}  // namespace

std::string checkpoint_step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

std::optional<int64_t> parse_checkpoint_step_name(const std::string& name) {
  if (name.size() <= 5 || name.size() > 5 + 18 || name.rfind("step_", 0) != 0) return std::nullopt;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(name[i]))) return std::nullopt;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

void write_checkpoint_manifest(const std::string& dir, int64_t step, uint64_t data_position,
                               const std::string& optimizer_state) {
  json files = json::object();
  for (auto& e : fs::directory_iterator(dir)) {
    KESTREL_CHECK(e.is_regular_file(), "checkpoint", "unexpected non-file ", e.path().string(), " in ", dir);
    FileDigest d = digest(e.path());
    files[e.path().filename().string()] = {{"bytes", d.bytes}, {"xxh64", d.xxh64}};
  }
  json m{{"format", kManifestFormat},
         {"step", step},
         {"data_position", data_position},
         {"optimizer_state", optimizer_state},
         {"files", files}};
  models::write_json_file((fs::path(dir) / "manifest.json").string(), m, "checkpoint");
}

std::string verify_checkpoint(const std::string& dir) {
  try {
    return verify_or_throw(fs::path(dir));
  } catch (const std::exception& e) {
    // Malformed JSON, a missing field, an unreadable file: the checkpoint is not intact.
    return e.what();
  }
}

std::vector<std::string> run_config_differences(const json& saved, const json& now) {
  std::vector<std::string> out;
  diff(saved, now, "", out);
  return out;
}

}  // namespace kestrel::train

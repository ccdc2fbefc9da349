// The PyTorch memory snapshot export: the pickle writer against an independent minimal pickle
// reader written here (and against python3's pickle module when python3 is on the PATH), then a
// profiled training run's snapshot, read back and replayed: its allocations and frees rebuild the
// profile's peak in use exactly, every entry names its tag, module and phase, and the blocks live
// before the log started appear once. On the device, tools/gpu-check style runs load the same
// file with torch.cuda._memory_viz (see bench/notes/memory_planning.md).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>

#include "kestrel/models/config.h"
#include "kestrel/runtime/memory_trace.h"
#include "kestrel/runtime/tensor.h"
#include "kestrel/train/memory_profile.h"
#include "kestrel/train/memory_viz_export.h"
#include "kestrel/train/pickle_writer.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
#include "trainer_fixtures.h"
#include "support/temp_dir.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

// ---- an independent reader of the pickle subset (opcode values from Python's pickletools) ----
class MiniUnpickler {
 public:
  explicit MiniUnpickler(const std::string& bytes) : b_(bytes) {}
  json load() {
    for (;;) {
      const auto op = static_cast<uint8_t>(next());
      switch (op) {
        case 0x80: next(); break;                      // PROTO n
        case '.': return pop();                        // STOP
        case '(': marks_.push_back(stack_.size()); break;
        case 'N': stack_.push_back(nullptr); break;
        case 0x88: stack_.push_back(true); break;
        case 0x89: stack_.push_back(false); break;
        case 'K': stack_.push_back(static_cast<uint8_t>(next())); break;
        case 'M': stack_.push_back(static_cast<int64_t>(le(2))); break;
        case 'J': stack_.push_back(static_cast<int64_t>(static_cast<int32_t>(le(4)))); break;
        case 0x8a: {                                   // LONG1
          const int n = static_cast<uint8_t>(next());
          uint64_t v = le(n);
          if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);  // sign-extend
          stack_.push_back(static_cast<int64_t>(v));
          break;
        }
        case 'X': {                                    // BINUNICODE
          const auto n = static_cast<size_t>(le(4));
          stack_.push_back(b_.substr(pos_, n));
          pos_ += n;
          break;
        }
        case '}': stack_.push_back(json::object()); break;
        case ']': stack_.push_back(json::array()); break;
        case 'u': {                                    // SETITEMS
          const size_t m = pop_mark();
          json& d = stack_[m - 1];
          for (size_t i = m; i + 1 < stack_.size(); i += 2) d[stack_[i].get<std::string>()] = stack_[i + 1];
          stack_.resize(m);
          break;
        }
        case 'e': {                                    // APPENDS
          const size_t m = pop_mark();
          json& l = stack_[m - 1];
          for (size_t i = m; i < stack_.size(); ++i) l.push_back(stack_[i]);
          stack_.resize(m);
          ++appends_batches_;
          break;
        }
        case 'q': memo_[static_cast<uint8_t>(next())] = stack_.back(); break;
        case 'r': memo_[static_cast<uint32_t>(le(4))] = stack_.back(); break;
        case 'h': stack_.push_back(memo_.at(static_cast<uint8_t>(next()))); break;
        case 'j': stack_.push_back(memo_.at(static_cast<uint32_t>(le(4)))); break;
        default: throw std::runtime_error("unexpected opcode " + std::to_string(op) + " at " + std::to_string(pos_ - 1));
      }
    }
  }
  int appends_batches_ = 0;

 private:
  char next() {
    if (pos_ >= b_.size()) throw std::runtime_error("truncated pickle");
    return b_[pos_++];
  }
  uint64_t le(int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(next())) << (8 * i);
    return v;
  }
  json pop() {
    json v = stack_.back();
    stack_.pop_back();
    return v;
  }
  size_t pop_mark() {
    size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }
  const std::string& b_;
  size_t pos_ = 0;
  std::vector<json> stack_;
  std::vector<size_t> marks_;
  std::map<uint32_t, json> memo_;
};

// Writes `v` (objects, arrays, strings, integers, booleans, null) with the writer under test.
void write_json(PickleWriter& w, const json& v) {
  if (v.is_null()) w.none();
  else if (v.is_boolean()) w.boolean(v.get<bool>());
  else if (v.is_number_integer()) w.integer(v.get<int64_t>());
  else if (v.is_string()) w.memo_string(v.get<std::string>());
  else if (v.is_array()) {
    w.begin_list();
    for (const json& x : v) write_json(w, x);
    w.end_list();
  } else {
    w.begin_dict();
    for (auto it = v.begin(); it != v.end(); ++it) {
      w.key(it.key());
      write_json(w, it.value());
    }
    w.end_dict();
  }
}

bool have_python3() { return std::system("python3 -c 'import pickle' >/dev/null 2>&1") == 0; }

// python3's pickle module reads the file; the result comes back as JSON.
json python_load(const std::string& path) {
  const std::string out = path + ".json";
  const std::string cmd = "python3 -c 'import pickle,json,sys; d=pickle.load(open(sys.argv[1],\"rb\")); "
                          "json.dump(d, open(sys.argv[2],\"w\"))' " + path + " " + out;
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream f(out);
  return json::parse(f);
}

std::string write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

TEST(PickleWriter, RoundTripsEveryTypeThroughAnIndependentReader) {
  std::mt19937_64 rng(1234);
  json v = json::object();
  // Integers at every encoding boundary, both signs, and random 64-bit values.
  json ints = json::array({0, 1, 255, 256, 65535, 65536, -1, -256, INT32_MAX, int64_t{INT32_MAX} + 1, INT32_MIN,
                           int64_t{INT32_MIN} - 1, int64_t{1} << 40, -(int64_t{1} << 40), int64_t{0x7f12345678ab},
                           INT64_MAX, INT64_MIN, int64_t{0x80}, int64_t{-0x80} - int64_t{1} * (int64_t{1} << 32)});
  for (int i = 0; i < 200; ++i) ints.push_back(static_cast<int64_t>(rng()) >> (rng() % 63));
  v["ints"] = ints;
  v["strings"] = json::array({"", "alloc", "decoder.layer.3.mlp", "ünïcode ✓", std::string(300, 'x'), "alloc"});
  v["flags"] = json::array({true, false, nullptr});
  // Containers larger than one batch (1000 items / pairs), nested.
  json big = json::array(), dict = json::object();
  for (int i = 0; i < 2500; ++i) big.push_back(json{{"i", i}, {"tag", i % 3 ? "activation" : "gradient"}});
  for (int i = 0; i < 1500; ++i) dict["k" + std::to_string(i)] = static_cast<int64_t>(rng() % 100000) - 50000;
  v["big"] = big;
  v["dict"] = dict;
  v["empty"] = json::object({{"list", json::array()}, {"dict", json::object()}});

  PickleWriter w;
  write_json(w, v);
  const std::string bytes = w.finish();
  ASSERT_EQ(static_cast<uint8_t>(bytes[0]), 0x80);
  ASSERT_EQ(bytes[1], 2) << "protocol 2";
  MiniUnpickler r(bytes);
  json back = r.load();
  EXPECT_EQ(back, v);
  EXPECT_GE(r.appends_batches_, 3) << "a 2500-item list is written in batches of 1000";

  // Shared objects: a memoized list referenced twice reads back twice.
  PickleWriter w2;
  w2.begin_list();
  w2.begin_list();
  w2.string("frame");
  w2.end_list();
  const uint32_t id = w2.memoize();
  w2.get(id);
  w2.end_list();
  json shared = MiniUnpickler(w2.finish()).load();
  EXPECT_EQ(shared, json::array({json::array({"frame"}), json::array({"frame"})}));

  if (!have_python3()) {
    std::printf("python3 not found: the python pickle check is skipped\n");
    return;
  }
  const std::string path = write_file((fs::temp_directory_path() / "kestrel_pickle_rt.pickle").string(), bytes);
  EXPECT_EQ(python_load(path), v) << "python3's pickle module reads the same values";
}

TEST(PickleWriter, RejectsMisuse) {
  PickleWriter w;
  w.begin_dict();
  w.key("a");
  EXPECT_THROW(w.end_dict(), Error);  // a key without a value
  PickleWriter w2;
  w2.begin_list();
  EXPECT_THROW(w2.finish(), Error);  // still open
  EXPECT_THROW(w2.get(7), Error);    // never memoized
}

using kestrel::testing::source_dir;

// Replays a snapshot's trace as torch's viewer does: returns the peak of bytes in use (blocks live
// at the start + allocs - frees); checks that every free matches an earlier alloc or a block the
// snapshot says existed before the trace.
int64_t replay_peak(const json& snap, int device, int64_t start_live, std::set<std::string>* labels) {
  std::map<int64_t, int64_t> live;
  int64_t in_use = start_live, peak = start_live;
  const json& trace = snap["device_traces"][device];
  for (const json& e : trace) {
    const std::string a = e["action"];
    const int64_t addr = e["addr"], size = e["size"];
    EXPECT_EQ(e["stream"], 0);
    EXPECT_TRUE(e["time_us"].is_number_integer());
    const json& f = e["frames"];
    EXPECT_EQ(f.size(), 2u);
    EXPECT_EQ(f[1]["filename"], "phase");
    if (labels) labels->insert(f[0]["filename"].get<std::string>() + "|" + f[0]["name"].get<std::string>());
    if (a == "alloc") {
      EXPECT_EQ(live.count(addr), 0u) << "address " << addr << " allocated twice";
      live[addr] = size;
      in_use += size;
      peak = std::max(peak, in_use);
    } else if (a == "free_completed") {
      if (auto it = live.find(addr); it != live.end()) {
        EXPECT_EQ(it->second, size);
        live.erase(it);
      } else {
        EXPECT_EQ(f[0]["filename"], "(allocated before the trace started)");
      }
      in_use -= size;
    } else {
      EXPECT_TRUE(a == "segment_alloc" || a == "segment_free" || a == "free_requested" || a == "oom") << a;
    }
  }
  // What the trace leaves live is exactly the snapshot's segments (minus the pre-trace blocks).
  int64_t seg_bytes = 0, seg_real = 0;
  for (const json& s : snap["segments"]) {
    EXPECT_EQ(s["device"], device);
    EXPECT_EQ(s["blocks"].size(), 1u);
    if (s["blocks"].size() != 1) continue;
    const json& b = s["blocks"][0];
    EXPECT_EQ(b["state"], "active_allocated");
    EXPECT_EQ(b["size"], s["total_size"]);
    seg_bytes += s["total_size"].get<int64_t>();
    if (live.count(s["address"].get<int64_t>())) seg_real += s["total_size"].get<int64_t>();
  }
  int64_t live_bytes = 0;
  for (auto& [a, s] : live) live_bytes += s;
  EXPECT_EQ(seg_real, live_bytes);
  EXPECT_EQ(seg_bytes, in_use) << "segments at the end hold what is in use";
  return peak;
}

TEST(MemoryViz, ProfiledRunReplaysToTheProfilePeakAndNamesWhoAllocated) {
  const std::string dir = (fs::temp_directory_path() / "kestrel_mem_viz").string();
  fs::remove_all(dir);
  json cfg = resolve_train_config(models::read_json_file(source_dir() + "/configs/quickstart_vlm.json", "config"), "q");
  cfg["train"]["steps"] = 2;
  cfg["train"]["batch_size"] = 24;
  cfg["recompute"] = "recompute";
  cfg["device"] = "cpu";
  cfg["log_every"] = 1000;
  cfg["out_dir"] = dir;
  // A block that exists before the log and survives it, and one freed inside it.
  Tensor kept, dropped;
  {
    TagScope tag(MemoryTag::Checkpoint);
    kept = Tensor::empty({3000}, DType::F32, Device::cpu());
    dropped = Tensor::empty({1000}, DType::F32, Device::cpu());
  }
  const int64_t in_use_at_start = memory_trace(Device::cpu()).snapshot().in_use;  // what the log's start sees
  MemoryProfile p = testing::profile_trainer_run(cfg, Device::cpu(), {}, [&] { dropped = Tensor(); });
  ASSERT_FALSE(p.viz.empty());
  write_memory_profile(p, dir);
  std::ifstream f(dir + "/memory_snapshot.pickle", std::ios::binary);
  ASSERT_TRUE(f.good()) << "write_memory_profile writes memory_snapshot.pickle";
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string bytes = ss.str();
  json snap = MiniUnpickler(bytes).load();
  ASSERT_TRUE(snap.contains("segments") && snap.contains("device_traces"));
  ASSERT_EQ(snap["device_traces"].size(), 1u);
  std::set<std::string> labels;
  const int64_t peak = replay_peak(snap, 0, in_use_at_start, &labels);
  EXPECT_EQ(peak, p.peak_in_use) << "the snapshot's allocations rebuild the profile's peak";
  // Who allocated: module labels with their tags, parameters by name, optimizer state.
  auto has = [&](const std::string& needle) {
    for (const std::string& l : labels)
      if (l.find(needle) != std::string::npos) return true;
    return false;
  };
  EXPECT_TRUE(has("decoder.layer.1.mlp|activation"));
  EXPECT_TRUE(has("vision.block.0"));
  EXPECT_TRUE(has("|gradient"));
  EXPECT_TRUE(has("|optimizer_state"));
  EXPECT_TRUE(has("|parameter"));
  EXPECT_TRUE(has("(allocated before the trace started)|checkpoint")) << "the block freed inside the log";
  // The pre-trace block still live at the end: one checkpoint segment of kept's size.
  int64_t pre = 0;
  for (const json& s : snap["segments"])
    if (s["blocks"][0]["frames"][0]["filename"] == "(allocated before the trace started)") pre += s["total_size"].get<int64_t>();
  EXPECT_EQ(pre, in_use_at_start - 4000) << "kept (12000 B) and whatever else was live before, minus dropped";
  // Phases: forward, backward and the recompute regions appear as second frames (the optimizer
  // phase allocates nothing on the CPU: AdamW's state exists from the start, zero_grad only frees).
  std::set<std::string> phases;
  for (const json& e : snap["device_traces"][0]) phases.insert(e["frames"][1]["name"].get<std::string>());
  for (const char* ph : {"forward", "backward"}) EXPECT_TRUE(phases.count(ph)) << ph;
  bool region = false;
  for (const std::string& ph : phases) region |= ph.rfind("region:", 0) == 0;
  EXPECT_TRUE(region);

  if (have_python3()) {
    // The same file through python3's pickle, checked with the invariant torch's `stats` asserts
    // (free + allocated == reserved per segment) and its trace replay.
    const std::string script = dir + "/check.py";
    std::ofstream(script) << R"(import pickle, sys
d = pickle.load(open(sys.argv[1], 'rb'))
for seg in d['segments']:
    alloc = sum(b['requested_size'] for b in seg['blocks'] if b['state'] == 'active_allocated')
    free = sum(b['size'] for b in seg['blocks'] if b['state'] != 'active_allocated')
    assert alloc + free == seg['total_size'], seg
live, cur, peak = {}, int(sys.argv[2]), int(sys.argv[2])
for e in d['device_traces'][0]:
    if e['action'] == 'alloc':
        live[e['addr']] = e['size']; cur += e['size']; peak = max(peak, cur)
    elif e['action'] == 'free_completed':
        live.pop(e['addr'], None); cur -= e['size']
assert peak == int(sys.argv[3]), (peak, sys.argv[3])
print('python3 pickle check ok:', len(d['device_traces'][0]), 'entries, peak', peak)
)";
    const std::string cmd = "python3 " + script + " " + dir + "/memory_snapshot.pickle " + std::to_string(in_use_at_start) +
                            " " + std::to_string(p.peak_in_use);
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kestrel::train

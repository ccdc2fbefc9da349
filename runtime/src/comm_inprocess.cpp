// The in-process communicator: N threads are the ranks of one group and meet at a shared
// Rendezvous. Policy:
// - a collective is two barriers. Each rank publishes {collective, dtype, count, root, pointers} and
//   arrives at the first; every rank then checks the published entries against rank 0's (so all
//   ranks throw the same error on a mismatch) and works on the others' buffers, which stay valid
//   because their owners wait at the second barrier before returning;
// - reductions: rank r reduces its share [r*n/N, (r+1)*n/N) of the elements into the group's
//   scratch, adding the ranks' values in rank order 0..N-1 in f32 (f64 for f64), the mean divides
//   that sum by N (the max takes the largest value, NaN when any rank's is); after the second barrier every rank rounds the scratch into its output once. The
//   order is fixed, so results are bit-identical run to run and equal the serial reference;
// - a rank that does not arrive within the timeout fails the waiting ranks naming it and aborts the
//   group (later collectives fail at once); abort() does the same with the caller's reason.
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <mutex>

#include "comm_common.h"

namespace kestrel {

namespace {

struct Entry {
  const char* collective = nullptr;
  DType dtype = DType::F32;
  int64_t count = 0;  // elements this rank sends (all_reduce: the tensor; reduce_scatter: the input)
  int root = 0;
  const void* in = nullptr;
  void* out = nullptr;
};

class Rendezvous {
 public:
  Rendezvous(int world, std::chrono::milliseconds timeout)
      : world_(world), timeout_(timeout), entries_(world), arrived_(world, false) {}

  int world() const { return world_; }
  std::vector<Entry>& entries() { return entries_; }
  std::vector<double>& scratch() { return scratch_; }

  // Waits until every rank has arrived (generation advances). `last` runs under the lock in the
  // last rank to arrive, before anyone is released.
  void arrive(int rank, const char* what, const std::function<void()>& last = {}) {
    std::unique_lock<std::mutex> lock(mu_);
    throw_if_aborted(rank, what);
    const uint64_t gen = generation_;
    arrived_[rank] = true;
    if (++count_ == world_) {
      if (last) last();
      count_ = 0;
      std::fill(arrived_.begin(), arrived_.end(), false);
      ++generation_;
      cv_.notify_all();
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    const bool released =
        cv_.wait_until(lock, deadline, [&] { return generation_ != gen || !abort_reason_.empty(); });
    if (generation_ != gen) return;  // completed (an abort after that belongs to a later collective)
    if (released) throw_if_aborted(rank, what);
    std::string missing;
    for (int r = 0; r < world_; ++r)
      if (!arrived_[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    const double secs = std::chrono::duration<double>(timeout_).count();
    abort_reason_ = detail::concat("rank ", rank, ": ", what, " timed out after ", secs, " s waiting for rank(s) ",
                                   missing);
    cv_.notify_all();
    throw make_error("comm", what, ": timed out after ", secs, " s waiting for rank(s) ", missing, " (this is rank ",
                     rank, " of ", world_, "): a peer died, is stuck, or called a different collective");
  }

  void abort(int rank, const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    if (abort_reason_.empty()) abort_reason_ = detail::concat("rank ", rank, ": ", reason);
    cv_.notify_all();
  }

 private:
  void throw_if_aborted(int rank, const char* what) const {
    if (!abort_reason_.empty())
      throw make_error("comm", what, ": aborted (this is rank ", rank, " of ", world_, "): ", abort_reason_);
  }

  const int world_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;
  int count_ = 0;
  std::vector<Entry> entries_;
  std::vector<bool> arrived_;
  std::vector<double> scratch_;
  std::string abort_reason_;
};

double load(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::F64: return static_cast<const double*>(p)[i];
    case DType::BF16: return bf16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::F16: return f16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    default: break;
  }
  throw make_error("internal", "comm load of ", dtype_name(dt));
}

void store(void* p, DType dt, int64_t i, double v) {
  switch (dt) {
    case DType::F32: static_cast<float*>(p)[i] = static_cast<float>(v); return;
    case DType::F64: static_cast<double*>(p)[i] = v; return;
    case DType::BF16: static_cast<uint16_t*>(p)[i] = float_to_bf16_bits(static_cast<float>(v)); return;
    case DType::F16: static_cast<uint16_t*>(p)[i] = float_to_f16_bits(static_cast<float>(v)); return;
    default: break;
  }
  throw make_error("internal", "comm store of ", dtype_name(dt));
}

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<Rendezvous> rv, int rank) : rv_(std::move(rv)), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return rv_->world(); }
  std::string backend() const override { return "inprocess"; }

  void all_reduce(Tensor& t, ReduceOp op) override {
    comm_detail::check_tensor("all_reduce", t, true, Device::cpu());
    reduce("all_reduce", t.data_ptr(), t.data_ptr(), t.dtype(), t.numel(), t.numel(), 0, op);
  }

  void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override {
    comm_detail::check_tensor("reduce_scatter", input, true, Device::cpu());
    comm_detail::check_tensor("reduce_scatter", output, true, Device::cpu());
    comm_detail::check_split("reduce_scatter", input, output, world_size());
    const int64_t n = output.numel();
    reduce("reduce_scatter", input.data_ptr(), output.data_ptr(), input.dtype(), input.numel(), n,
           static_cast<int64_t>(rank_) * n, op);
  }

  void all_gather(const Tensor& input, Tensor& output) override {
    comm_detail::check_tensor("all_gather", input, false, Device::cpu());
    comm_detail::check_tensor("all_gather", output, false, Device::cpu());
    comm_detail::check_split("all_gather", output, input, world_size());
    publish("all_gather", input.dtype(), input.numel(), 0, input.data_ptr(), output.data_ptr());
    const size_t bytes = input.nbytes();
    auto& e = rv_->entries();
    for (int r = 0; r < world_size(); ++r)
      std::memcpy(static_cast<char*>(output.data_ptr()) + r * bytes, e[r].in, bytes);
    rv_->arrive(rank_, "all_gather");
  }

  void broadcast(Tensor& t, int root) override {
    comm_detail::check_tensor("broadcast", t, false, Device::cpu());
    KESTREL_CHECK(root >= 0 && root < world_size(), "comm", "broadcast: root ", root, " is not a rank of a group of ",
                  world_size());
    publish("broadcast", t.dtype(), t.numel(), root, t.data_ptr(), t.data_ptr());
    if (rank_ != root) std::memcpy(t.data_ptr(), rv_->entries()[root].in, t.nbytes());
    rv_->arrive(rank_, "broadcast");
  }

  void reduce(Tensor& t, int root, ReduceOp op) override {
    comm_detail::check_tensor("reduce", t, true, Device::cpu());
    KESTREL_CHECK(root >= 0 && root < world_size(), "comm", "reduce: root ", root, " is not a rank of a group of ",
                  world_size());
    // Only the root copies the result out (the others' tensors keep their inputs).
    reduce("reduce", t.data_ptr(), t.data_ptr(), t.dtype(), t.numel(), rank_ == root ? t.numel() : 0, 0, op, root);
  }

  void barrier() override {
    publish("barrier", DType::U8, 0, 0, nullptr, nullptr);
    rv_->arrive(rank_, "barrier");
  }

  void abort(const std::string& reason) override { rv_->abort(rank_, reason); }

 private:
  // Publishes this rank's entry, waits for all, and checks every entry matches rank 0's.
  void publish(const char* what, DType dt, int64_t count, int root, const void* in, void* out) {
    rv_->entries()[rank_] = Entry{what, dt, count, root, in, out};
    rv_->arrive(rank_, what);
    const auto& e = rv_->entries();
    for (int r = 1; r < world_size(); ++r) {
      if (std::strcmp(e[r].collective, e[0].collective) != 0) {
        rv_->arrive(rank_, what);  // let the others finish reading before anyone leaves
        throw make_error("comm", what, ": rank 0 called ", e[0].collective, " but rank ", r, " called ",
                         e[r].collective, " (every rank must call the same collectives in the same order)");
      }
      if (e[r].dtype != e[0].dtype || e[r].count != e[0].count || e[r].root != e[0].root) {
        rv_->arrive(rank_, what);
        throw make_error("comm", what, ": rank ", r, " passed ", e[r].count, " ", dtype_name(e[r].dtype),
                         " elements (root ", e[r].root, ") but rank 0 passed ", e[0].count, " ",
                         dtype_name(e[0].dtype), " (root ", e[0].root, ")");
      }
    }
  }

  // acc folded with the next rank's value: a sum (Sum, Avg) or the max with NaN winning (Max).
  template <typename T>
  static T combine(T acc, T v, ReduceOp op) {
    if (op != ReduceOp::Max) return acc + v;
    return std::isnan(acc) || std::isnan(v) ? std::numeric_limits<T>::quiet_NaN() : std::max(acc, v);
  }

  // Reduces the ranks' `count` inputs; this rank receives elements [first, first + n) in `out`.
  // `root`: reduce's (the ranks must agree on it, as on broadcast's); 0 for the others.
  void reduce(const char* what, const void* in, void* out, DType dt, int64_t count, int64_t n, int64_t first,
              ReduceOp op, int root = 0) {
    rv_->entries()[rank_] = Entry{what, dt, count, root, in, out};
    rv_->arrive(rank_, what, [this, count] { rv_->scratch().assign(static_cast<size_t>(count), 0.0); });
    const auto& e = rv_->entries();
    for (int r = 1; r < world_size(); ++r)
      if (std::strcmp(e[r].collective, e[0].collective) != 0 || e[r].dtype != e[0].dtype || e[r].count != e[0].count ||
          e[r].root != e[0].root) {
        rv_->arrive(rank_, what);
        throw make_error("comm", what, ": rank ", r, " called ", e[r].collective, " with ", e[r].count, " ",
                         dtype_name(e[r].dtype), " elements (root ", e[r].root, ") but rank 0 called ",
                         e[0].collective, " with ", e[0].count, " ", dtype_name(e[0].dtype), " (root ", e[0].root, ")");
      }
    const int world = world_size();
    const int64_t lo = count * rank_ / world, hi = count * (rank_ + 1) / world;
    double* s = rv_->scratch().data();
    const bool wide = dt == DType::F64;
    for (int64_t i = lo; i < hi; ++i) {
      if (wide) {
        double acc = load(e[0].in, dt, i);
        for (int r = 1; r < world; ++r) acc = combine(acc, load(e[r].in, dt, i), op);
        s[i] = op == ReduceOp::Avg ? acc / world : acc;
      } else {
        float acc = static_cast<float>(load(e[0].in, dt, i));
        for (int r = 1; r < world; ++r) acc = combine(acc, static_cast<float>(load(e[r].in, dt, i)), op);
        s[i] = op == ReduceOp::Avg ? acc / static_cast<float>(world) : acc;
      }
    }
    rv_->arrive(rank_, what);  // every share reduced; the inputs are no longer read
    for (int64_t i = 0; i < n; ++i) store(out, dt, i, s[first + i]);
    // The scratch is rewritten only after the next collective's first barrier, which this rank
    // reaches after its copy: no third barrier needed.
  }

  std::shared_ptr<Rendezvous> rv_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_inprocess_group(int world_size, const CommOptions& options) {
  KESTREL_CHECK(world_size >= 1, "comm", "in-process group: world size must be >= 1, got ", world_size);
  KESTREL_CHECK(options.timeout.count() > 0, "comm", "in-process group: the timeout must be positive");
  auto rv = std::make_shared<Rendezvous>(world_size, options.timeout);
  std::vector<std::unique_ptr<Communicator>> group;
  for (int r = 0; r < world_size; ++r) group.push_back(std::make_unique<InProcessCommunicator>(rv, r));
  return group;
}

}  // namespace kestrel

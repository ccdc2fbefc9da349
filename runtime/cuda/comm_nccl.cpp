// The NCCL communicator (built only where nccl.h and libnccl are found; communicator.h). Policy:
// - one dedicated communication stream per device (non-blocking, so it never serialises with
//   the legacy default stream; kept for the process's life, see comm_stream). Each collective first makes the comm stream wait, by event, for
//   the work queued so far on the caller's current stream (the compute stream, or whatever a
//   StreamGuard set), runs there, and records a done-event; `wait()` makes the caller's current
//   stream wait for that event, so compute and communication overlap until the results are needed;
// - the tensors' blocks are recorded on the comm stream (Allocator::record_stream), so a tensor
//   freed on the compute stream while its collective is in flight is not reused before it lands;
// - the communicator is created non-blocking (ncclConfig_t.blocking = 0) and its initialisation
//   polled against the timeout; a rank that never joins aborts the communicator with an error.
//   Collectives themselves are asynchronous: a dead peer is detected where the host waits on them
//   (synchronize(), which the trainer calls once per step, barrier(), the destructor), which poll
//   the comm stream and NCCL's async error against the timeout and abort instead of hanging;
// - NCCL's own device memory (its buffers and channels) is measured when the communicator is built
//   (cuda::refresh_external: the drop in free memory not reserved by our allocator) and so counts
//   as External in the device's trace and against the memory budget;
// - libnccl is opened at run time (dlopen "libnccl.so.2", the first time a communicator or unique
//   id is asked for), as libcuda is: libkestrel has no load-time dependency on it, so every other
//   binary runs where NCCL is absent, and asking for NCCL there is an error naming the library.
//   nccl.h supplies the types and signatures only.
#include <dlfcn.h>
#include <nccl.h>

#include <chrono>
#include <map>
#include <mutex>
#include <cstring>
#include <thread>

#include "src/comm_common.h"
#include "kestrel/cuda/check.h"
#include "kestrel/cuda/context.h"
#include "kestrel/cuda/memory.h"
#include "kestrel/runtime/allocator.h"

#define KESTREL_NCCL_CHECK(expr)                                                                          \
  do {                                                                                                    \
    ncclResult_t kestrel_nr_ = (expr);                                                                    \
    if (kestrel_nr_ != ncclSuccess && kestrel_nr_ != ncclInProgress)                                      \
      throw ::kestrel::make_error("nccl", #expr, " failed: ", nccl().GetErrorString(kestrel_nr_), " (",    \
                                  nccl().GetLastError(nullptr), ") (", __FILE__, ":", __LINE__, ")");        \
  } while (0)

namespace kestrel {

namespace {

using Clock = std::chrono::steady_clock;

// The NCCL entry points, resolved once from libnccl.so.2.
struct NcclApi {
  decltype(&ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&ncclCommInitRankConfig) CommInitRankConfig = nullptr;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&ncclCommFinalize) CommFinalize = nullptr;
  decltype(&ncclCommDestroy) CommDestroy = nullptr;
  decltype(&ncclCommAbort) CommAbort = nullptr;
  decltype(&ncclAllReduce) AllReduce = nullptr;
  decltype(&ncclReduceScatter) ReduceScatter = nullptr;
  decltype(&ncclAllGather) AllGather = nullptr;
  decltype(&ncclBroadcast) Broadcast = nullptr;
  decltype(&ncclReduce) Reduce = nullptr;
  decltype(&ncclGetErrorString) GetErrorString = nullptr;
  decltype(&ncclGetLastError) GetLastError = nullptr;
};

template <typename F>
void resolve(void* lib, F& fn, const char* name) {
  fn = reinterpret_cast<F>(::dlsym(lib, name));
  KESTREL_CHECK(fn != nullptr, "comm", "libnccl.so.2 has no ", name, " (NCCL older than 2.19?)");
}

NcclApi load_nccl() {
  void* lib = ::dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = ::dlerror();
    throw make_error("comm", "cannot load libnccl.so.2 (", why ? why : "unknown",
                     "): install NCCL or put its lib folder on LD_LIBRARY_PATH (e.g. /usr/local/cuda/lib64)");
  }
  NcclApi a;
  resolve(lib, a.GetUniqueId, "ncclGetUniqueId");
  resolve(lib, a.CommInitRankConfig, "ncclCommInitRankConfig");
  resolve(lib, a.CommGetAsyncError, "ncclCommGetAsyncError");
  resolve(lib, a.CommFinalize, "ncclCommFinalize");
  resolve(lib, a.CommDestroy, "ncclCommDestroy");
  resolve(lib, a.CommAbort, "ncclCommAbort");
  resolve(lib, a.AllReduce, "ncclAllReduce");
  resolve(lib, a.ReduceScatter, "ncclReduceScatter");
  resolve(lib, a.AllGather, "ncclAllGather");
  resolve(lib, a.Broadcast, "ncclBroadcast");
  resolve(lib, a.Reduce, "ncclReduce");
  resolve(lib, a.GetErrorString, "ncclGetErrorString");
  resolve(lib, a.GetLastError, "ncclGetLastError");
  return a;  // the library stays open for the process's life
}

// The device's communication stream: created once and kept for the process's life, as the
// context's own streams are, because blocks recorded on it (record_stream) may be freed, and their
// segments released, after a communicator is gone. Communicators on one device share it.
cudaStream_t comm_stream(int device) {
  static std::mutex mu;
  static std::map<int, cudaStream_t> streams;
  std::lock_guard<std::mutex> lock(mu);
  cudaStream_t& s = streams[device];
  if (!s) {
    cuda::DeviceGuard g(device);
    KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  return s;
}

// Throws (and retries on the next call) where libnccl cannot be loaded.
const NcclApi& nccl() {
  static const NcclApi api = load_nccl();
  return api;
}

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::F32: return ncclFloat32;
    case DType::BF16: return ncclBfloat16;
    case DType::F16: return ncclFloat16;
    case DType::F64: return ncclFloat64;
    default: break;
  }
  throw make_error("internal", "no NCCL reduction type for ", dtype_name(d));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;
    case ReduceOp::Max: return ncclMax;
  }
  throw make_error("internal", "no NCCL reduction for op ", static_cast<int>(op));
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const std::vector<uint8_t>& id_bytes, int rank, int world, int device, const CommOptions& opt)
      : rank_(rank), world_(world), device_(device), timeout_(opt.timeout) {
    KESTREL_CHECK(id_bytes.size() == sizeof(ncclUniqueId), "comm", "NCCL unique id must be ", sizeof(ncclUniqueId),
                  " bytes, got ", id_bytes.size());
    KESTREL_CHECK(world >= 1 && rank >= 0 && rank < world, "comm", "rank ", rank, " is not a rank of a group of ",
                  world);
    cuda::DeviceGuard g(device);
    cuda::init(device);  // the allocator and the free-memory baseline exist before NCCL's memory does
    ncclUniqueId id;
    std::memcpy(&id, id_bytes.data(), sizeof id);
    stream_ = comm_stream(device);
    ready_ = std::make_unique<cuda::Event>();
    done_ = std::make_unique<cuda::Event>();
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // initialisation and collectives return at once; we poll against the timeout
    KESTREL_NCCL_CHECK(nccl().CommInitRankConfig(&comm_, world, id, rank, &config));
    poll_ready("initialisation (waiting for every rank to join)");
    // NCCL's buffers are now allocated: charge them to the budget as External.
    cuda::refresh_external(device);
    scratch_ = Tensor::zeros({1}, DType::F32, Device::cuda(device));
  }

  ~NcclCommunicator() override {
    cuda::DeviceGuard g(device_);
    if (comm_) {
      // Wait (bounded) for in-flight collectives; abort rather than hang on a dead peer.
      bool done = false;
      const auto deadline = Clock::now() + timeout_;
      while (Clock::now() < deadline) {
        ncclResult_t async = ncclSuccess;
        nccl().CommGetAsyncError(comm_, &async);
        if (async != ncclSuccess && async != ncclInProgress) break;
        cudaError_t q = cudaStreamQuery(stream_);
        if (q == cudaSuccess) {
          done = true;
          break;
        }
        if (q != cudaErrorNotReady) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (done) {
        nccl().CommFinalize(comm_);
        poll_ready_nothrow();
        nccl().CommDestroy(comm_);
      } else {
        nccl().CommAbort(comm_);
      }
    }
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend() const override { return "nccl"; }

  void all_reduce(Tensor& t, ReduceOp op) override {
    comm_detail::check_tensor("all_reduce", t, true, Device::cuda(device_));
    auto s = begin({&t});
    KESTREL_NCCL_CHECK(nccl().AllReduce(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()),
                                     nccl_op(op), comm_, stream_));
    end("all_reduce");
  }

  void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) override {
    comm_detail::check_tensor("reduce_scatter", input, true, Device::cuda(device_));
    comm_detail::check_tensor("reduce_scatter", output, true, Device::cuda(device_));
    comm_detail::check_split("reduce_scatter", input, output, world_);
    auto s = begin({&input, &output});
    KESTREL_NCCL_CHECK(nccl().ReduceScatter(input.data_ptr(), output.data_ptr(), static_cast<size_t>(output.numel()),
                                         nccl_type(input.dtype()), nccl_op(op), comm_,
                                         stream_));
    end("reduce_scatter");
  }

  void all_gather(const Tensor& input, Tensor& output) override {
    comm_detail::check_tensor("all_gather", input, false, Device::cuda(device_));
    comm_detail::check_tensor("all_gather", output, false, Device::cuda(device_));
    comm_detail::check_split("all_gather", output, input, world_);
    auto s = begin({&input, &output});
    KESTREL_NCCL_CHECK(nccl().AllGather(input.data_ptr(), output.data_ptr(), input.nbytes(), ncclUint8, comm_, stream_));
    end("all_gather");
  }

  void broadcast(Tensor& t, int root) override {
    comm_detail::check_tensor("broadcast", t, false, Device::cuda(device_));
    KESTREL_CHECK(root >= 0 && root < world_, "comm", "broadcast: root ", root, " is not a rank of a group of ", world_);
    auto s = begin({&t});
    KESTREL_NCCL_CHECK(nccl().Broadcast(t.data_ptr(), t.data_ptr(), t.nbytes(), ncclUint8, root, comm_, stream_));
    end("broadcast");
  }

  void reduce(Tensor& t, int root, ReduceOp op) override {
    comm_detail::check_tensor("reduce", t, true, Device::cuda(device_));
    KESTREL_CHECK(root >= 0 && root < world_, "comm", "reduce: root ", root, " is not a rank of a group of ", world_);
    auto s = begin({&t});
    KESTREL_NCCL_CHECK(nccl().Reduce(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()),
                                  nccl_op(op), root, comm_, stream_));
    end("reduce");
  }

  // A one-element all-reduce, then a bounded host wait for the comm stream.
  void barrier() override {
    all_reduce(scratch_, ReduceOp::Sum);
    wait_bounded("barrier");
  }

  void synchronize() override { wait_bounded("synchronize"); }

  void wait() override {
    cuda::DeviceGuard g(device_);
    KESTREL_CUDA_CHECK(cudaStreamWaitEvent(cuda::current_stream(device_), done_->get(), 0));
  }

  void abort(const std::string& reason) override {
    if (comm_) nccl().CommAbort(comm_);
    comm_ = nullptr;
    abort_reason_ = reason;
  }

 private:
  // Orders the comm stream after the caller's stream; records the tensors' blocks on the comm stream.
  std::unique_ptr<cuda::DeviceGuard> begin(std::initializer_list<const Tensor*> tensors) {
    KESTREL_CHECK(comm_, "comm", "the NCCL communicator was aborted", abort_reason_.empty() ? "" : ": ", abort_reason_);
    auto g = std::make_unique<cuda::DeviceGuard>(device_);
    KESTREL_CUDA_CHECK(cudaEventRecord(ready_->get(), cuda::current_stream(device_)));
    KESTREL_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_->get(), 0));
    for (const Tensor* t : tensors)
      allocator_for(t->device()).record_stream(t->storage()->allocation(), stream_);
    return g;
  }

  void end(const char* what) {
    poll_ready(what);
    KESTREL_CUDA_CHECK(cudaEventRecord(done_->get(), stream_));
  }

  // Non-blocking NCCL calls may return ncclInProgress; the call is enqueued once the async state
  // leaves it. Bounded by the timeout.
  void poll_ready(const char* what) {
    const auto deadline = Clock::now() + timeout_;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      KESTREL_NCCL_CHECK(nccl().CommGetAsyncError(comm_, &state));
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        nccl().CommAbort(comm_);
        comm_ = nullptr;
        throw make_error("comm", what, ": NCCL failed: ", nccl().GetErrorString(state));
      }
      if (Clock::now() >= deadline) {
        nccl().CommAbort(comm_);
        comm_ = nullptr;
        throw make_error("comm", what, ": timed out after ", std::chrono::duration<double>(timeout_).count(),
                         " s (rank ", rank_, " of ", world_, "); the communicator is aborted");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  // The host waits for the comm stream's last collective, polling NCCL's async error, at most the
  // timeout: the point where a dead peer becomes an error (the communicator is aborted).
  void wait_bounded(const char* what) {
    KESTREL_CHECK(comm_, "comm", what, ": the NCCL communicator was aborted",
                  abort_reason_.empty() ? "" : ": ", abort_reason_);
    const auto deadline = Clock::now() + timeout_;
    for (;;) {
      ncclResult_t async = ncclSuccess;
      KESTREL_NCCL_CHECK(nccl().CommGetAsyncError(comm_, &async));
      if (async != ncclSuccess && async != ncclInProgress) {
        nccl().CommAbort(comm_);
        comm_ = nullptr;
        throw make_error("comm", what, ": NCCL failed: ", nccl().GetErrorString(async));
      }
      cudaError_t q = cudaEventQuery(done_->get());
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) KESTREL_CUDA_CHECK(q);
      if (Clock::now() >= deadline) {
        nccl().CommAbort(comm_);
        comm_ = nullptr;
        throw make_error("comm", what, ": timed out after ", std::chrono::duration<double>(timeout_).count(),
                         " s (rank ", rank_, " of ", world_, "): a peer died or is stuck; the communicator is aborted");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  void poll_ready_nothrow() noexcept {
    const auto deadline = Clock::now() + timeout_;
    ncclResult_t state = ncclInProgress;
    while (state == ncclInProgress && Clock::now() < deadline) {
      if (nccl().CommGetAsyncError(comm_, &state) != ncclSuccess) return;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  int rank_, world_, device_;
  std::chrono::milliseconds timeout_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;  // comm_stream(device_), not owned
  std::unique_ptr<cuda::Event> ready_, done_;  // created on the communicator's device
  Tensor scratch_;
  std::string abort_reason_;
};

}  // namespace

bool nccl_available() {
  try {
    nccl();
    return true;
  } catch (const Error&) {
    return false;
  }
}

std::vector<uint8_t> nccl_unique_id() {
  ncclUniqueId id;
  KESTREL_NCCL_CHECK(nccl().GetUniqueId(&id));
  std::vector<uint8_t> bytes(sizeof id);
  std::memcpy(bytes.data(), &id, sizeof id);
  return bytes;
}

std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<uint8_t>& unique_id, int rank, int world_size,
                                                     int device, const CommOptions& options) {
  return std::make_unique<NcclCommunicator>(unique_id, rank, world_size, device, options);
}

}  // namespace kestrel

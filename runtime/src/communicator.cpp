// The single-rank communicator (every collective is the identity, after the same argument checks as
// the other backends) and, where the library was built without NCCL, the NCCL entry points that
// refuse with a message naming what is missing.
#include "comm_common.h"

#ifndef KESTREL_WITH_NCCL
#define KESTREL_WITH_NCCL 0
#endif

namespace kestrel {

namespace {

class SingleRankCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string backend() const override { return "single"; }
  void all_reduce(Tensor& t, ReduceOp) override { comm_detail::check_tensor("all_reduce", t, true, t.device()); }
  void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp) override {
    comm_detail::check_tensor("reduce_scatter", input, true, input.device());
    comm_detail::check_split("reduce_scatter", input, output, 1);
    if (input.data_ptr() != output.data_ptr()) output.copy_(input.view(output.shape()));
  }
  void all_gather(const Tensor& input, Tensor& output) override {
    comm_detail::check_tensor("all_gather", input, false, input.device());
    comm_detail::check_split("all_gather", output, input, 1);
    if (input.data_ptr() != output.data_ptr()) output.copy_(input.view(output.shape()));
  }
  void broadcast(Tensor& t, int root) override {
    KESTREL_CHECK(root == 0, "comm", "broadcast: root ", root, " is not a rank of a group of 1");
  }
  void barrier() override {}
  void abort(const std::string&) override {}
};

}  // namespace

std::unique_ptr<Communicator> make_single_rank_communicator() { return std::make_unique<SingleRankCommunicator>(); }

#if !KESTREL_WITH_NCCL
bool nccl_available() { return false; }
std::vector<uint8_t> nccl_unique_id() {
  throw make_error("comm", "NCCL backend not built: this library was built without NCCL (configure with "
                           "-DKESTREL_CUDA=ON where nccl.h and libnccl are found)");
}
std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<uint8_t>&, int, int, int, const CommOptions&) {
  nccl_unique_id();  // throws
  return nullptr;
}
#endif

}  // namespace kestrel

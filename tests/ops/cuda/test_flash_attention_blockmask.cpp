// Block-sparse 2-D attention masks on the GPU (AttentionOptions::block_mask, FlashBlockMask): the
// CUDA op against the CPU reference op (f64 accumulation, itself checked against a float64
// full-matrix reference in tests/ops/test_attention_blockmask.cpp), run in f32 on the same
// bf16/f16-rounded inputs: out, lse, dq, dk, dv with the budgets of the prefix-LM GPU test. Random
// masks at several densities (skipped, FULL and PARTIAL tiles, random bits, an empty query block,
// a key block no query sees, rows with no visible key), token counts that end mid-tile, len_q !=
// len_k, GQA, head dims 64/128 (and 72, padded to 128), bf16 and f16; a lower-triangular mask
// against the causal kernel; the refusals (deterministic, the mma.sync head dims, device masks
// not built by make_block_mask or altered after building).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kestrel/autograd/tape.h"
#include "kestrel/ops/attention.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/reduce.h"
#include "support/gpu.h"
#include "support/numerics.h"

namespace kestrel {
namespace {
using testing::randn;

constexpr int64_t kB = BlockMask::kBlock;

// Same budgets as test_flash_attention.cu / test_flash_attention_prefix.cpp.
double tol_out(DType t) { return t == DType::BF16 ? 1e-2 : 4e-3; }
double tol_grad(DType t) { return t == DType::BF16 ? 2e-2 : 8e-3; }

Tensor cu(int64_t n) { return Tensor::from_vector(std::vector<int64_t>{0, n}, {2}, DType::I32); }

// A random mask: each tile pair listed with probability `density`, a listed tile FULL with
// probability `full`, else PARTIAL with bits drawn at a per-tile density (every 17th row empty);
// query block empty_qb lists nothing and key block empty_kb is listed by none (-1: none).
BlockMask random_mask(int64_t tq, int64_t tk, double density, double full, uint32_t seed, int64_t empty_qb,
                      int64_t empty_kb) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  const int64_t nqb = (tq + kB - 1) / kB, nkb = (tk + kB - 1) / kB;
  std::vector<int32_t> q_ptr{0}, q_kblock, q_kind;
  std::vector<uint32_t> bits;
  for (int64_t qb = 0; qb < nqb; ++qb) {
    for (int64_t kb = 0; kb < nkb; ++kb) {
      if (qb == empty_qb || kb == empty_kb || u(rng) >= density) continue;
      q_kblock.push_back(static_cast<int32_t>(kb));
      if (u(rng) < full) {
        q_kind.push_back(BlockMask::kFull);
        continue;
      }
      const double bit_p = 0.1 + 0.8 * u(rng);
      q_kind.push_back(static_cast<int32_t>(bits.size() / (kB * 4)));
      std::vector<uint32_t> tile(kB * 4, 0);
      for (int64_t r = 0; r < kB && qb * kB + r < tq; ++r)
        for (int64_t c = 0; c < kB && kb * kB + c < tk; ++c)
          if (r % 17 != 5 && u(rng) < bit_p) tile[r * 4 + c / 32] |= 1u << (c % 32);
      bits.insert(bits.end(), tile.begin(), tile.end());
    }
    q_ptr.push_back(static_cast<int32_t>(q_kblock.size()));
  }
  return make_block_mask(tq, tk, q_ptr, q_kblock, q_kind, bits);
}

struct Outputs {
  Tensor out, lse, dq, dk, dv;  // CPU, f32
};

Outputs run_op(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, const AttentionOptions& base,
               Device dev) {
  Tensor qd = q.to(dev).set_requires_grad(true), kd = k.to(dev).set_requires_grad(true);
  Tensor vd = v.to(dev).set_requires_grad(true);
  AttentionOptions o = base;
  if (o.block_mask.defined()) o.block_mask = o.block_mask.to(dev);
  const int64_t tq = q.shape()[0], tk = k.shape()[0];
  AttentionOutput r = attention(qd, kd, vd, cu(tq).to(dev), cu(tk).to(dev), tq, tk, o);
  autograd::backward(sum(mul(r.out, dout.to(dev))));
  auto host = [](const Tensor& t) { return t.to(Device::cpu()).to(DType::F32); };
  return Outputs{host(r.out), host(r.lse), host(qd.grad()), host(kd.grad()), host(vd.grad())};
}

struct Inputs {
  Tensor q, k, v, dout;  // rounded to the dtype once
};
Inputs draw(int64_t tq, int64_t tk, int64_t hq, int64_t hkv, int64_t d, DType dt) {
  return Inputs{randn({tq, hq, d}).to(dt), randn({tk, hkv, d}).to(dt), randn({tk, hkv, d}).to(dt),
                randn({tq, hq, d}).to(dt)};
}

struct Errors {
  double out, dq, dk, dv;
};
Errors errors(const Outputs& got, const Outputs& ref) {
  return {testing::rel_l2(got.out, ref.out), testing::rel_l2_floored(got.dq, ref.dq, 1e-3),
          testing::rel_l2_floored(got.dk, ref.dk, 1e-3), testing::rel_l2_floored(got.dv, ref.dv, 1e-3)};
}

void expect_lse(const Outputs& got, const Outputs& ref) {
  std::vector<float> lg = got.lse.to_float_vector(), lr = ref.lse.to_float_vector();
  size_t bad = 0, empty = 0;
  for (size_t i = 0; i < lr.size(); ++i) {
    if (std::isinf(lr[i])) {
      ++empty;
      bad += !(std::isinf(lg[i]) && lg[i] < 0);
    } else {
      bad += !(std::abs(lg[i] - lr[i]) <= 1e-3 * (1 + std::abs(lr[i])));
    }
  }
  EXPECT_EQ(bad, 0u) << "lse rows off the reference (or not -inf where no key is visible), " << empty << " empty rows";
}

void run_case(int64_t tq, int64_t tk, int64_t hq, int64_t hkv, int64_t d, double density, double full, uint32_t seed,
              DType dt, int64_t empty_qb = 1, int64_t empty_kb = 0) {
  const BlockMask mask = random_mask(tq, tk, density, full, seed, empty_qb, empty_kb);
  SCOPED_TRACE(::testing::Message() << "Tq=" << tq << " Tk=" << tk << " Hq=" << hq << " Hkv=" << hkv << " D=" << d
                                    << " density=" << density << " tiles=" << mask.nnz()
                                    << " partial=" << mask.partials() << " " << dtype_name(dt));
  const Inputs in = draw(tq, tk, hq, hkv, d, dt);
  AttentionOptions o;
  o.causal = false;
  o.block_mask = mask;
  const Outputs ref = run_op(in.q.to(DType::F32), in.k.to(DType::F32), in.v.to(DType::F32), in.dout.to(DType::F32), o,
                             Device::cpu());
  const Outputs got = run_op(in.q, in.k, in.v, in.dout, o, Device::cuda(0));
  for (const Tensor* t : {&got.out, &got.dq, &got.dk, &got.dv}) EXPECT_TRUE(testing::all_finite(*t));
  const Errors e = errors(got, ref);
  std::printf("[flash blockmask] T=%lldx%lld D=%-3lld density %.2f tiles %lld partial %lld %s out %.2e dq %.2e dk %.2e "
              "dv %.2e\n",
              static_cast<long long>(tq), static_cast<long long>(tk), static_cast<long long>(d), density,
              static_cast<long long>(mask.nnz()), static_cast<long long>(mask.partials()),
              std::string(dtype_name(dt)).c_str(), e.out, e.dq, e.dk, e.dv);
  EXPECT_LE(e.out, tol_out(dt));
  EXPECT_LE(e.dq, tol_grad(dt));
  EXPECT_LE(e.dk, tol_grad(dt));
  EXPECT_LE(e.dv, tol_grad(dt));
  expect_lse(got, ref);
}

TEST(FlashAttentionBlockMaskCuda, RandomMasksAtSeveralDensities) {
  KESTREL_REQUIRE_GPU();
  uint32_t seed = 1;
  for (int64_t d : {64, 128})
    for (double density : {0.1, 0.5, 0.9}) {
      run_case(1000, 1000, 4, 2, d, density, 0.5, seed, seed % 2 ? DType::BF16 : DType::F16);
      ++seed;
    }
}

TEST(FlashAttentionBlockMaskCuda, CrossLengthsGqaAndPaddedHeadDim) {
  KESTREL_REQUIRE_GPU();
  for (int64_t d : {64, 128}) {
    run_case(700, 1100, 8, 1, d, 0.5, 0.3, 101 + d, DType::BF16, 2, 4);  // last query block 60 rows
    run_case(1100, 300, 2, 2, d, 0.6, 0.0, 201 + d, DType::F16, 0, 2);    // every listed tile PARTIAL
    run_case(129, 257, 4, 4, d, 1.0, 1.0, 301 + d, DType::BF16, -1, -1);  // every tile FULL
  }
  run_case(900, 900, 4, 2, 72, 0.5, 0.5, 401, DType::BF16);  // padded to the 128 kernels
  run_case(3000, 3000, 8, 2, 128, 0.5, 0.5, 402, DType::BF16, 5, 7);  // many tiles per block
}

// A lower-triangular mask (diagonal tiles PARTIAL) against the causal kernel on the same inputs:
// both against the reference, and against each other within the same budget.
TEST(FlashAttentionBlockMaskCuda, CausalMaskMatchesCausalKernel) {
  KESTREL_REQUIRE_GPU();
  for (int64_t d : {64, 128}) {
    const int64_t T = 1500;
    const Inputs in = draw(T, T, 4, 2, d, DType::BF16);
    AttentionOptions masked;
    masked.causal = false;
    masked.block_mask = block_mask_from_predicate(T, T, [](int64_t i, int64_t j) { return j <= i; });
    AttentionOptions causal;
    const Outputs a = run_op(in.q, in.k, in.v, in.dout, masked, Device::cuda(0));
    const Outputs b = run_op(in.q, in.k, in.v, in.dout, causal, Device::cuda(0));
    const Outputs ref = run_op(in.q.to(DType::F32), in.k.to(DType::F32), in.v.to(DType::F32),
                               in.dout.to(DType::F32), causal, Device::cpu());
    const Errors ea = errors(a, ref), eb = errors(b, ref), ab = errors(a, b);
    std::printf("[flash blockmask causal] D=%lld mask vs ref out %.2e dq %.2e dk %.2e dv %.2e | causal kernel vs ref "
                "out %.2e dq %.2e dk %.2e dv %.2e | mask vs causal out %.2e dq %.2e\n",
                static_cast<long long>(d), ea.out, ea.dq, ea.dk, ea.dv, eb.out, eb.dq, eb.dk, eb.dv, ab.out, ab.dq);
    for (const Errors& e : {ea, ab}) {
      EXPECT_LE(e.out, tol_out(DType::BF16));
      EXPECT_LE(e.dq, tol_grad(DType::BF16));
      EXPECT_LE(e.dk, tol_grad(DType::BF16));
      EXPECT_LE(e.dv, tol_grad(DType::BF16));
    }
    // FA's rule: the masked kernel's error at most about twice the causal kernel's (plus a floor).
    EXPECT_LE(ea.out, 2 * eb.out + 1e-4);
    EXPECT_LE(ea.dq, 2 * eb.dq + 1e-4);
    EXPECT_LE(ea.dk, 2 * eb.dk + 1e-4);
    EXPECT_LE(ea.dv, 2 * eb.dv + 1e-4);
    expect_lse(a, ref);
  }
}

TEST(FlashAttentionBlockMaskCuda, Refusals) {
  KESTREL_REQUIRE_GPU();
  auto expect_error = [](int64_t d, bool deterministic, const std::string& what) {
    const Inputs in = draw(300, 300, 2, 2, d, DType::BF16);
    AttentionOptions o;
    o.causal = false;
    o.deterministic = deterministic;
    o.block_mask = random_mask(300, 300, 0.5, 0.5, 7, -1, -1);
    try {
      run_op(in.q, in.k, in.v, in.dout, o, Device::cuda(0));
      ADD_FAILURE() << "no error for " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_error(128, true, "the deterministic backward is not built with a block mask");
  expect_error(256, false, "a block mask is implemented by the Hopper kernels");
}

// The kernels trust the mask's indices, so the op takes only device masks that are to() of a built
// mask: a device mask assembled by hand (even from valid contents), one with an out-of-range key
// block or kind swapped in after building, and a CPU mask are refused on the host before any
// launch; the device stays usable and the built mask then gives the reference's result.
TEST(FlashAttentionBlockMaskCuda, OnlyBuiltMasksReachTheKernels) {
  KESTREL_REQUIRE_GPU();
  const Device dev = Device::cuda(0);
  const int64_t T = 300;
  const Inputs in = draw(T, T, 2, 2, 64, DType::BF16);
  const BlockMask host = random_mask(T, T, 0.5, 0.5, 9, -1, -1);
  const BlockMask built = host.to(dev);
  ASSERT_EQ(built.validation_problem(), "");
  auto expect_refused = [&](const BlockMask& m, const std::string& what) {
    AttentionOptions o;
    o.causal = false;
    o.block_mask = m;
    try {
      attention(in.q.to(dev), in.k.to(dev), in.v.to(dev), cu(T).to(dev), cu(T).to(dev), T, T, o);
      ADD_FAILURE() << "no error for " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  BlockMask hand;
  hand.total_q = hand.total_k = T;
  hand.q_ptr = built.q_ptr.clone();
  hand.q_kblock = built.q_kblock.clone();
  hand.q_kind = built.q_kind.clone();
  hand.k_ptr = built.k_ptr.clone();
  hand.k_qblock = built.k_qblock.clone();
  hand.k_kind = built.k_kind.clone();
  hand.bits = built.bits.clone();
  hand.bits_t = built.bits_t.clone();
  expect_refused(hand, "block_mask was not built by make_block_mask");
  BlockMask far = built;
  far.q_kblock = Tensor::full(built.q_kblock.shape(), 1 << 24, DType::I32, dev);  // key block far out of range
  expect_refused(far, "q_kblock was replaced");
  BlockMask kinds = built;
  kinds.k_kind = Tensor::full(built.k_kind.shape(), 1 << 24, DType::I32, dev);  // PARTIAL index out of range
  expect_refused(kinds, "k_kind was replaced");
  expect_refused(host, "block_mask.q_ptr must be on cuda");

  AttentionOptions o;
  o.causal = false;
  o.block_mask = built;
  const Outputs got = run_op(in.q, in.k, in.v, in.dout, o, dev);
  o.block_mask = host;
  const Outputs ref = run_op(in.q.to(DType::F32), in.k.to(DType::F32), in.v.to(DType::F32), in.dout.to(DType::F32), o,
                             Device::cpu());
  const Errors e = errors(got, ref);
  EXPECT_LE(e.out, tol_out(DType::BF16));
  EXPECT_LE(e.dq, tol_grad(DType::BF16));
  EXPECT_LE(e.dk, tol_grad(DType::BF16));
  EXPECT_LE(e.dv, tol_grad(DType::BF16));
}

}  // namespace
}  // namespace kestrel

// attention with a block-sparse 2-D mask (AttentionOptions::block_mask, kestrel::BlockMask): random
// descriptions (skipped, FULL and PARTIAL 128 x 128 tiles, random bits, query blocks with no key
// block, key blocks seen by no query, rows whose bits are all clear) turned into a dense boolean
// mask by the definition, forward and backward against an independent float64 full-matrix
// implementation, gradients by finite differences in f64; the builders (dense mask, predicate)
// against the description; FULL everywhere = bidirectional and a causal mask = causal, exactly;
// every argument error; only masks from the builders (and to() of one) are accepted by the op.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kestrel/autograd/tape.h"
#include "kestrel/ops/attention.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/reduce.h"
#include "masked_attention_reference.h"
#include "support/numerics.h"

namespace kestrel {
namespace {
using testing::randn;

constexpr int64_t kB = BlockMask::kBlock;

using testing::host_f64;
using testing::rel_err;
Tensor cu(int64_t n) { return Tensor::from_vector(std::vector<int64_t>{0, n}, {2}, DType::I32); }

// A random description and the dense [Tq x Tk] visibility it means (written from the definition).
struct RandomMask {
  int64_t tq, tk;
  std::vector<int32_t> q_ptr{0}, q_kblock, q_kind;
  std::vector<uint32_t> bits;
  std::vector<char> dense;  // [tq * tk]
  int64_t full = 0, partial = 0;
};

// density: chance that a tile pair is listed; full: chance that a listed tile is FULL. Query block
// `empty_qb` lists nothing, key block `empty_kb` is listed by no query block (-1 = none).
RandomMask random_mask(int64_t tq, int64_t tk, double density, double full, uint32_t seed, int64_t empty_qb = -1,
                       int64_t empty_kb = -1) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  RandomMask m{tq, tk};
  m.dense.assign(tq * tk, 0);
  const int64_t nqb = (tq + kB - 1) / kB, nkb = (tk + kB - 1) / kB;
  for (int64_t qb = 0; qb < nqb; ++qb) {
    for (int64_t kb = 0; kb < nkb; ++kb) {
      if (qb == empty_qb || kb == empty_kb || u(rng) >= density) continue;
      m.q_kblock.push_back(static_cast<int32_t>(kb));
      const bool is_full = u(rng) < full;
      const double bit_p = u(rng);  // per-tile bit density, so some tiles are sparse and some dense
      std::vector<uint32_t> tile(kB * 4, 0);
      for (int64_t r = 0; r < kB && qb * kB + r < tq; ++r) {
        const bool empty_row = !is_full && r % 17 == 5;  // rows with no visible key in this tile
        for (int64_t c = 0; c < kB && kb * kB + c < tk; ++c) {
          const bool vis = is_full || (!empty_row && u(rng) < bit_p);
          if (!vis) continue;
          tile[r * 4 + c / 32] |= 1u << (c % 32);
          m.dense[(qb * kB + r) * tk + kb * kB + c] = 1;
        }
      }
      if (is_full) {
        m.q_kind.push_back(BlockMask::kFull);
        ++m.full;
      } else {
        m.q_kind.push_back(static_cast<int32_t>(m.bits.size() / (kB * 4)));
        m.bits.insert(m.bits.end(), tile.begin(), tile.end());
        ++m.partial;
      }
    }
    m.q_ptr.push_back(static_cast<int32_t>(m.q_kblock.size()));
  }
  return m;
}

using Ref = testing::AttentionRef;

// The shared f64 reference (masked_attention_reference.h) under a dense mask (one document).
Ref reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, const std::vector<char>& mask) {
  const int64_t tq = q.shape()[0], tk = k.shape()[0];
  return testing::masked_attention_reference(q, k, v, dout, {tq}, {tk}, [&](size_t, int64_t i, int64_t j, int64_t, int64_t nk) {
    return mask[i * nk + j] != 0;
  });
}

void check(const RandomMask& rm, int64_t Hq, int64_t Hkv, int64_t D, DType dt) {
  SCOPED_TRACE(::testing::Message() << "Tq=" << rm.tq << " Tk=" << rm.tk << " full=" << rm.full
                                    << " partial=" << rm.partial << " Hq=" << Hq << " Hkv=" << Hkv << " D=" << D
                                    << " " << dtype_name(dt));
  Tensor q = randn({rm.tq, Hq, D}, dt).set_requires_grad(true);
  Tensor k = randn({rm.tk, Hkv, D}, dt).set_requires_grad(true);
  Tensor v = randn({rm.tk, Hkv, D}, dt).set_requires_grad(true);
  Tensor dout = randn({rm.tq, Hq, D}, dt);
  AttentionOptions o;
  o.causal = false;
  o.block_mask = make_block_mask(rm.tq, rm.tk, rm.q_ptr, rm.q_kblock, rm.q_kind, rm.bits);
  AttentionOutput r = attention(q, k, v, cu(rm.tq), cu(rm.tk), rm.tq, rm.tk, o);
  autograd::backward(sum(mul(r.out, dout)));
  const Ref ref = reference(q, k, v, dout, rm.dense);
  // Gradients in f64 are bounded by the f32 lse that the backward recomputes P from.
  const double tol = dt == DType::F64 ? 1e-11 : 2 * testing::dtype_tolerance(dt);
  const double gtol = dt == DType::F64 ? 1e-6 : 2 * testing::dtype_tolerance(dt);
  EXPECT_LT(rel_err(host_f64(r.out), ref.out), tol);
  EXPECT_LT(rel_err(host_f64(q.grad()), ref.dq), gtol);
  EXPECT_LT(rel_err(host_f64(k.grad()), ref.dk), gtol);
  EXPECT_LT(rel_err(host_f64(v.grad()), ref.dv), gtol);
  const std::vector<double> lse = host_f64(r.lse), out = host_f64(r.out), dq = host_f64(q.grad());
  int64_t empty_rows = 0;
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(ref.lse[i])) {
      ++empty_rows;
      EXPECT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << "row " << i;
      for (int64_t c = 0; c < D; ++c) {  // no visible key: out 0 and dq 0, exactly
        EXPECT_EQ(out[i * D + c], 0.0) << "row " << i;
        EXPECT_EQ(dq[i * D + c], 0.0) << "row " << i;
      }
    } else {
      EXPECT_NEAR(lse[i], ref.lse[i], 1e-5 * (1 + std::abs(ref.lse[i]))) << "row " << i;
    }
  }
  EXPECT_GT(empty_rows, 0) << "the mask was meant to leave some rows without a key";
}

TEST(AttentionBlockMask, RandomMasksAgainstFullMatrixReference) {
  // Odd token counts (partial last blocks), len_q != len_k, an empty query block and an unseen key block.
  check(random_mask(300, 270, 0.5, 0.5, 1, /*empty_qb=*/1, /*empty_kb=*/0), 4, 2, 16, DType::F64);
  check(random_mask(257, 400, 0.3, 0.2, 2, 2, 3), 2, 1, 8, DType::F64);
  check(random_mask(384, 384, 0.8, 0.7, 3, 0, 2), 3, 3, 12, DType::F64);
  check(random_mask(129, 129, 1.0, 0.0, 4, -1, -1), 2, 2, 8, DType::F64);  // every tile PARTIAL
}

TEST(AttentionBlockMask, Dtypes) {
  check(random_mask(300, 300, 0.5, 0.5, 5, 1, 1), 4, 2, 32, DType::F32);
  check(random_mask(200, 260, 0.6, 0.4, 6, 0, 1), 4, 1, 64, DType::BF16);
  check(random_mask(260, 200, 0.6, 0.4, 7, 1, 0), 2, 2, 32, DType::F16);
}

TEST(AttentionBlockMask, GradcheckF64) {
  for (uint32_t seed : {11u, 12u}) {
    const RandomMask rm = random_mask(130, 140, 0.75, 0.5, seed);
    AttentionOptions o;
    o.causal = false;
    o.block_mask = make_block_mask(rm.tq, rm.tk, rm.q_ptr, rm.q_kblock, rm.q_kind, rm.bits);
    EXPECT_TRUE(testing::gradcheck(
        [&](const std::vector<Tensor>& in) { return attention(in[0], in[1], in[2], cu(130), cu(140), 130, 140, o).out; },
        {randn({130, 2, 3}, DType::F64), randn({140, 1, 3}, DType::F64), randn({140, 1, 3}, DType::F64)}));
  }
}

TEST(AttentionBlockMask, BuildersMatchTheDescription) {
  const RandomMask rm = random_mask(300, 270, 0.5, 0.5, 21, 1, 0);
  const BlockMask a = make_block_mask(rm.tq, rm.tk, rm.q_ptr, rm.q_kblock, rm.q_kind, rm.bits);
  std::vector<int64_t> dense64(rm.dense.begin(), rm.dense.end());
  const BlockMask b = block_mask_from_dense(Tensor::from_vector(dense64, {rm.tq, rm.tk}, DType::I32));
  // The builder classifies tiles by content: listed tiles with bits all set become FULL, a PARTIAL
  // tile with no set bit is skipped. Compare what each means, pair by pair, through the column view
  // too (bits_t), and the row view of the dense builder to the description where kinds agree.
  auto visible = [](const BlockMask& m, int64_t i, int64_t j, bool column) {
    const int32_t* ptr = (column ? m.k_ptr : m.q_ptr).data<int32_t>();
    const int32_t* blk = (column ? m.k_qblock : m.q_kblock).data<int32_t>();
    const int32_t* kind = (column ? m.k_kind : m.q_kind).data<int32_t>();
    const uint32_t* bits = reinterpret_cast<const uint32_t*>((column ? m.bits_t : m.bits).data_ptr());
    const int64_t x = column ? j : i, y = column ? i : j;
    for (int32_t e = ptr[x / kB]; e < ptr[x / kB + 1]; ++e) {
      if (blk[e] != y / kB) continue;
      if (kind[e] < 0) return true;
      return ((bits[(kind[e] * kB + x % kB) * 4 + (y % kB) / 32] >> (y % 32)) & 1u) != 0;
    }
    return false;
  };
  int64_t bad = 0;
  for (int64_t i = 0; i < rm.tq; ++i)
    for (int64_t j = 0; j < rm.tk; ++j)
      for (const BlockMask* m : {&a, &b})
        for (bool column : {false, true}) bad += visible(*m, i, j, column) != (rm.dense[i * rm.tk + j] != 0);
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(a.nnz(), rm.full + rm.partial);
  EXPECT_LE(b.nnz(), a.nnz());
  // A predicate builder of a lower-triangular mask: diagonal tiles PARTIAL, the rest FULL or skipped.
  const BlockMask c = block_mask_from_predicate(300, 300, [](int64_t i, int64_t j) { return j <= i; });
  EXPECT_EQ(c.nnz(), 6);  // 3 query blocks: 1 + 2 + 3 tiles
  EXPECT_EQ(c.partials(), 3);
}

TEST(AttentionBlockMask, FullMaskIsBidirectionalAndCausalMaskIsCausal) {
  Tensor q = randn({300, 4, 16}), k = randn({300, 2, 16}), v = randn({300, 2, 16});
  AttentionOptions bidir;
  bidir.causal = false;
  AttentionOptions full = bidir;
  full.block_mask = block_mask_from_predicate(300, 300, [](int64_t, int64_t) { return true; });
  EXPECT_EQ(full.block_mask.partials(), 0);
  EXPECT_EQ(testing::rel_l2(attention(q, k, v, cu(300), 300, full), attention(q, k, v, cu(300), 300, bidir)), 0.0);
  AttentionOptions causal;
  AttentionOptions tri = bidir;
  tri.block_mask = block_mask_from_predicate(300, 300, [](int64_t i, int64_t j) { return j <= i; });
  EXPECT_EQ(testing::rel_l2(attention(q, k, v, cu(300), 300, tri), attention(q, k, v, cu(300), 300, causal)), 0.0);
}

template <typename F>
void expect_error(F&& f, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << "no error for " << what;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

TEST(AttentionBlockMask, Errors) {
  Tensor q = randn({200, 2, 8}), k = randn({200, 2, 8}), v = randn({200, 2, 8});
  const BlockMask ok = block_mask_from_predicate(200, 200, [](int64_t i, int64_t j) { return (i + j) % 3 != 0; });
  auto run = [&](const AttentionOptions& o) { attention(q, k, v, cu(200), 200, o); };
  AttentionOptions o;
  o.block_mask = ok;
  expect_error([&] { run(o); }, "block_mask combines with causal = false only");
  o.causal = false;
  o.window = 16;
  expect_error([&] { run(o); }, "is implemented for causal attention only");
  o.window = 0;
  expect_error([&] { attention(q, k, v, Tensor::from_vector(std::vector<int64_t>{0, 100, 200}, {3}, DType::I32), 100, o); },
               "block_mask describes one packed sequence");
  expect_error([&] { attention(q, k, v, cu(200), cu(200), 256, 200, o); }, "max_seqlen_q/k must equal");
  o.block_mask = block_mask_from_predicate(200, 150, [](int64_t, int64_t) { return true; });
  expect_error([&] { run(o); }, "block_mask is 200 x 150 tokens");
  o.block_mask = ok;
  o.block_mask.k_kind = ok.q_kind.clone();  // swapped view: a mask whose views disagree
  o.block_mask.k_qblock = ok.q_kblock.clone();
  o.block_mask.k_kind.data<int32_t>()[0] = 0;
  expect_error([&] { run(o); }, "block_mask was not built by make_block_mask");
  o.block_mask = ok;
  o.block_mask.bits = Tensor();
  expect_error([&] { run(o); }, "block_mask.bits must be contiguous i32");
  o.block_mask = ok;
  EXPECT_NO_THROW(run(o));

  // make_block_mask's validation.
  const std::vector<uint32_t> none;
  std::vector<uint32_t> one(kB * 4, 0);
  one[0] = 1;
  expect_error([&] { make_block_mask(200, 200, {0, 1}, {0}, {-1}, none); }, "q_ptr must have q_blocks + 1 = 3");
  expect_error([&] { make_block_mask(200, 200, {0, 2, 1}, {0, 1}, {-1, -1}, none); }, "q_ptr must be non-decreasing");
  expect_error([&] { make_block_mask(200, 200, {0, 1, 1}, {2}, {-1}, none); }, "lists key block 2, out of [0, 2)");
  expect_error([&] { make_block_mask(200, 200, {0, 2, 2}, {1, 0}, {-1, -1}, none); }, "strictly increasing");
  expect_error([&] { make_block_mask(200, 200, {0, 1, 1}, {0}, {1}, one); }, "is neither kFull (-1) nor a PARTIAL");
  expect_error([&] { make_block_mask(200, 200, {0, 0, 0}, {}, {}, one); }, "PARTIAL bits 0 used by no tile");
  expect_error([&] { make_block_mask(200, 200, {0, 1, 2}, {0, 0}, {0, 0}, one); }, "PARTIAL bits 0 used by two tiles");
  std::vector<uint32_t> past(kB * 4, 0);
  past[100 * 4] = 1;  // query row 128 + 100 = 228 >= 200
  expect_error([&] { make_block_mask(200, 200, {0, 0, 1}, {1}, {0}, past); }, "set a bit past total_q / total_k");
  expect_error([&] { make_block_mask(200, 200, {0, 0, 0}, {}, {}, std::vector<uint32_t>(7)); }, "whole tiles");
}

// The op takes only masks that came out of the validating builders (or to() of one): a mask set
// up field by field, or a built one with a tensor replaced or re-pointed afterwards, is refused
// before any kernel reads it, even when its contents happen to be valid; copies and to() of a
// built mask keep working and give the same result.
TEST(AttentionBlockMask, OnlyBuiltMasksAreTrusted) {
  Tensor q = randn({300, 2, 8}), k = randn({260, 1, 8}), v = randn({260, 1, 8});
  const Tensor cq = cu(300), ck = cu(260);
  auto run = [&](const BlockMask& m) {
    AttentionOptions o;
    o.causal = false;
    o.block_mask = m;
    return attention(q, k, v, cq, ck, 300, 260, o).out;
  };
  const std::string refused = "block_mask was not built by make_block_mask (or one of its tensors was replaced "
                              "after building; here: ";
  const std::string fix = "build it with make_block_mask / block_mask_from_predicate / block_mask_from_dense";
  auto visible = [](int64_t i, int64_t j) { return (i * 7 + j) % 5 != 0; };
  const BlockMask built = block_mask_from_predicate(300, 260, visible);
  ASSERT_GT(built.partials(), 0);
  EXPECT_EQ(built.validation_problem(), "");
  const Tensor expected = run(built);

  // (a) Hand-assembled: the built mask's own contents, field by field (structurally valid), and
  // the very same tensors (shared), are both refused: only the builders vouch for a mask.
  for (bool share : {false, true}) {
    BlockMask hand;
    hand.total_q = built.total_q;
    hand.total_k = built.total_k;
    auto take = [&](const Tensor& t) { return share ? t : t.clone(); };
    hand.q_ptr = take(built.q_ptr);
    hand.q_kblock = take(built.q_kblock);
    hand.q_kind = take(built.q_kind);
    hand.k_ptr = take(built.k_ptr);
    hand.k_qblock = take(built.k_qblock);
    hand.k_kind = take(built.k_kind);
    hand.bits = take(built.bits);
    hand.bits_t = take(built.bits_t);
    expect_error([&] { run(hand); }, refused + "it carries no validation record: its fields were set by hand");
    expect_error([&] { run(hand); }, fix);
    // Moving does not launder it.
    expect_error([&] { run(hand.to(Device::cpu())); }, "it carries no validation record");
  }

  // (b) Built, then one tensor replaced: an out-of-range key block (2 key blocks), a same-valued
  // clone, a FULL kind swapped for an out-of-range PARTIAL index.
  {
    BlockMask m = built;
    std::vector<int64_t> kb = m.q_kblock.to_int_vector();
    kb[0] = 1000;
    m.q_kblock = Tensor::from_vector(kb, m.q_kblock.shape(), DType::I32);
    expect_error([&] { run(m); }, refused + "q_kblock was replaced): " + fix);
    expect_error([&] { run(m.to(Device::cpu())); }, "moved with to() while not valid");
  }
  {
    BlockMask m = built;
    m.bits_t = built.bits_t.clone();
    expect_error([&] { run(m); }, "bits_t was replaced");
  }
  {
    BlockMask m = built;
    m.k_kind = Tensor::full(built.k_kind.shape(), 1 << 20, DType::I32);
    expect_error([&] { run(m); }, "k_kind was replaced");
  }
  // Re-pointed through the shared impl (a fresh mask: copies share it): other storage, same shape.
  {
    BlockMask m = block_mask_from_predicate(300, 260, visible);
    const Tensor other = Tensor::full(m.q_kind.shape(), 99, DType::I32);
    m.q_kind.impl().storage = other.storage();
    expect_error([&] { run(m); }, "q_kind was re-pointed");
  }

  // (c) Copies (sharing the record) and to() (a new record for the copied tensors) still run, and
  // give exactly the built mask's result; a replaced field restored to the validated tensor is
  // accepted again (the record names tensors, not a moment).
  const BlockMask copy = built;
  const BlockMask moved = built.to(Device::cpu());
  EXPECT_EQ(moved.validation_problem(), "");
  EXPECT_EQ(testing::rel_l2(run(copy), expected), 0.0);
  EXPECT_EQ(testing::rel_l2(run(moved), expected), 0.0);
  BlockMask restored = built;
  restored.q_ptr = built.q_ptr.clone();
  EXPECT_NE(restored.validation_problem(), "");
  restored.q_ptr = built.q_ptr;
  EXPECT_EQ(testing::rel_l2(run(restored), expected), 0.0);
}

}  // namespace
}  // namespace kestrel

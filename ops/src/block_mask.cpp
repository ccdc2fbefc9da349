// BlockMask builders (kestrel/ops/attention.h): validation of the row view, the column view and
// the transposed bits built from it once on the host (O(nnz + partials x 128 x 128), no T x T
// buffer), and the predicate / dense-mask conveniences, which classify each 128 x 128 tile as
// skipped, FULL or PARTIAL. Policy: validation happens here, once; the result is sealed with a
// record of what was validated (BlockMask::Validation, created only in this file), which
// attention() checks in O(1) per call instead of re-validating the contents.
#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <vector>

#include "kestrel/ops/attention.h"
#include "kestrel/runtime/error.h"

namespace kestrel {
namespace {

constexpr const char* kOp = "block_mask";
constexpr int64_t kB = BlockMask::kBlock;
constexpr int64_t kWords = kB / 32;            // u32 words per tile row
constexpr int64_t kTileWords = kB * kWords;    // u32 words per tile

Tensor i32_tensor(const void* data, int64_t n, const Shape& shape) {
  Tensor t = Tensor::empty(shape, DType::I32);
  if (n > 0) std::memcpy(t.data_ptr(), data, static_cast<size_t>(n) * 4);
  return t;
}

}  // namespace

// What make_block_mask validated: the token counts and, per tensor, the tensor itself (its impl,
// held so its address cannot be reused by another) and the metadata it had then, so that a field
// replaced by another tensor, or re-pointed at other memory through impl(), no longer matches.
struct BlockMask::Validation {
  struct Seen {
    Tensor tensor;
    std::shared_ptr<Storage> storage;
    int64_t offset;
    Shape shape;
    Strides strides;
    DType dtype;
  };
  int64_t total_q, total_k;
  std::array<Seen, 8> seen;
};

namespace {

constexpr std::array<const char*, 8> kFieldNames{"q_ptr", "q_kblock", "q_kind", "k_ptr",
                                                 "k_qblock", "k_kind", "bits", "bits_t"};

std::array<const Tensor*, 8> fields_of(const BlockMask& m) {
  return {&m.q_ptr, &m.q_kblock, &m.q_kind, &m.k_ptr, &m.k_qblock, &m.k_kind, &m.bits, &m.bits_t};
}

}  // namespace

void BlockMask::seal() {
  auto v = std::make_shared<Validation>();
  v->total_q = total_q;
  v->total_k = total_k;
  const auto fields = fields_of(*this);
  for (size_t i = 0; i < fields.size(); ++i) {
    const Tensor& t = *fields[i];
    KESTREL_ASSERT(t.defined());
    v->seen[i] = Validation::Seen{t, t.storage(), t.offset(), t.shape(), t.strides(), t.dtype()};
  }
  validation_ = std::move(v);
}

std::string BlockMask::validation_problem() const {
  if (!validation_)
    return "it carries no validation record: its fields were set by hand, or it was moved with to() while not valid";
  const Validation& v = *validation_;
  if (total_q != v.total_q || total_k != v.total_k)
    return "total_q x total_k changed from " + std::to_string(v.total_q) + " x " + std::to_string(v.total_k) +
           " to " + std::to_string(total_q) + " x " + std::to_string(total_k);
  const auto fields = fields_of(*this);
  for (size_t i = 0; i < fields.size(); ++i) {
    const Tensor& t = *fields[i];
    const Validation::Seen& s = v.seen[i];
    if (!t.same_as(s.tensor)) return std::string(kFieldNames[i]) + " was replaced";
    if (t.storage() != s.storage || t.offset() != s.offset || t.shape() != s.shape || t.strides() != s.strides ||
        t.dtype() != s.dtype)
      return std::string(kFieldNames[i]) + " was re-pointed (its storage, offset, shape or dtype changed)";
  }
  return {};
}

BlockMask BlockMask::to(Device device) const {
  BlockMask m = *this;
  for (Tensor* t : {&m.q_ptr, &m.q_kblock, &m.q_kind, &m.k_ptr, &m.k_qblock, &m.k_kind, &m.bits, &m.bits_t})
    if (t->defined()) *t = t->to(device);
  // The copies hold the validated contents: validated iff the source is (checked before the copy
  // is sealed, so a hand-built or altered mask does not become trusted by moving).
  m.validation_.reset();
  if (validation_problem().empty()) m.seal();
  return m;
}

BlockMask make_block_mask(int64_t total_q, int64_t total_k, const std::vector<int32_t>& q_ptr,
                          const std::vector<int32_t>& q_kblock, const std::vector<int32_t>& q_kind,
                          const std::vector<uint32_t>& bits) {
  KESTREL_CHECK(total_q >= 0 && total_k >= 0 && total_q < (int64_t{1} << 31) && total_k < (int64_t{1} << 31), kOp,
                "total_q and total_k must be in [0, 2^31), got ", total_q, ", ", total_k);
  const int64_t nqb = (total_q + kB - 1) / kB, nkb = (total_k + kB - 1) / kB;
  KESTREL_CHECK(static_cast<int64_t>(q_ptr.size()) == nqb + 1, kOp, "q_ptr must have q_blocks + 1 = ", nqb + 1,
                " entries (total_q ", total_q, " in blocks of ", kB, "), got ", q_ptr.size());
  KESTREL_CHECK(q_ptr[0] == 0, kOp, "q_ptr[0] must be 0, got ", q_ptr[0]);
  for (int64_t b = 0; b < nqb; ++b)
    KESTREL_CHECK(q_ptr[b + 1] >= q_ptr[b], kOp, "q_ptr must be non-decreasing, got ", q_ptr[b], " then ",
                  q_ptr[b + 1], " at query block ", b);
  const int64_t nnz = q_ptr[nqb];
  KESTREL_CHECK(static_cast<int64_t>(q_kblock.size()) == nnz && static_cast<int64_t>(q_kind.size()) == nnz, kOp,
                "q_kblock and q_kind must have q_ptr.back() = ", nnz, " entries, got ", q_kblock.size(), " and ",
                q_kind.size());
  KESTREL_CHECK(bits.size() % kTileWords == 0, kOp, "bits must hold whole tiles of ", kB, " x ", kWords,
                " words, got ", bits.size(), " words");
  const int64_t partials = static_cast<int64_t>(bits.size()) / kTileWords;
  std::vector<int> used(partials, 0);
  std::vector<int32_t> k_count(nkb + 1, 0);
  for (int64_t b = 0; b < nqb; ++b) {
    for (int64_t e = q_ptr[b]; e < q_ptr[b + 1]; ++e) {
      const int32_t kb = q_kblock[e], kind = q_kind[e];
      KESTREL_CHECK(kb >= 0 && kb < nkb, kOp, "query block ", b, " lists key block ", kb, ", out of [0, ", nkb,
                    ") (total_k ", total_k, ")");
      KESTREL_CHECK(e == q_ptr[b] || kb > q_kblock[e - 1], kOp, "query block ", b,
                    ": key blocks must be strictly increasing, got ", q_kblock[e - 1], " then ", kb);
      KESTREL_CHECK(kind == BlockMask::kFull || (kind >= 0 && kind < partials), kOp, "query block ", b,
                    ", key block ", kb, ": kind ", kind, " is neither kFull (-1) nor a PARTIAL index in [0, ",
                    partials, ")");
      if (kind >= 0) {
        KESTREL_CHECK(used[kind] == 0, kOp, "PARTIAL bits ", kind, " used by two tiles");
        used[kind] = 1;
        // Bits past the sequence's ends must be clear (the kernels rely on the bounds alone there).
        const int64_t rows = std::min(kB, total_q - b * kB), cols = std::min(kB, total_k - int64_t{kb} * kB);
        for (int64_t r = 0; r < kB; ++r)
          for (int64_t w = 0; w < kWords; ++w) {
            const uint32_t word = bits[kind * kTileWords + r * kWords + w];
            const int64_t valid = r < rows ? std::clamp<int64_t>(cols - 32 * w, 0, 32) : 0;
            const uint32_t allowed = valid >= 32 ? ~0u : ((1u << valid) - 1u);
            KESTREL_CHECK((word & ~allowed) == 0, kOp, "PARTIAL bits ", kind, " (query block ", b, ", key block ",
                          kb, ") set a bit past total_q / total_k at row ", r, ", word ", w);
          }
      }
      ++k_count[kb + 1];
    }
  }
  for (int64_t p = 0; p < partials; ++p) KESTREL_CHECK(used[p], kOp, "PARTIAL bits ", p, " used by no tile");

  // Column view: counting sort by key block; query blocks come out increasing (rows walked in order).
  std::vector<int32_t> k_ptr(nkb + 1, 0), k_qblock(nnz), k_kind(nnz);
  for (int64_t b = 0; b < nkb; ++b) k_ptr[b + 1] = k_ptr[b] + k_count[b + 1];
  std::vector<int32_t> fill(k_ptr.begin(), k_ptr.end() - 1);
  for (int64_t b = 0; b < nqb; ++b)
    for (int64_t e = q_ptr[b]; e < q_ptr[b + 1]; ++e) {
      const int32_t at = fill[q_kblock[e]]++;
      k_qblock[at] = static_cast<int32_t>(b);
      k_kind[at] = q_kind[e];
    }
  std::vector<uint32_t> bits_t(bits.size(), 0);
  for (int64_t p = 0; p < partials; ++p)
    for (int64_t r = 0; r < kB; ++r)
      for (int64_t c = 0; c < kB; ++c)
        if ((bits[p * kTileWords + r * kWords + c / 32] >> (c % 32)) & 1u)
          bits_t[p * kTileWords + c * kWords + r / 32] |= 1u << (r % 32);

  BlockMask m;
  m.total_q = total_q;
  m.total_k = total_k;
  m.q_ptr = i32_tensor(q_ptr.data(), nqb + 1, {nqb + 1});
  m.q_kblock = i32_tensor(q_kblock.data(), nnz, {nnz});
  m.q_kind = i32_tensor(q_kind.data(), nnz, {nnz});
  m.k_ptr = i32_tensor(k_ptr.data(), nkb + 1, {nkb + 1});
  m.k_qblock = i32_tensor(k_qblock.data(), nnz, {nnz});
  m.k_kind = i32_tensor(k_kind.data(), nnz, {nnz});
  m.bits = i32_tensor(bits.data(), partials * kTileWords, {partials, kB, kWords});
  m.bits_t = i32_tensor(bits_t.data(), partials * kTileWords, {partials, kB, kWords});
  m.seal();
  return m;
}

BlockMask block_mask_from_predicate(int64_t total_q, int64_t total_k,
                                    const std::function<bool(int64_t, int64_t)>& visible) {
  KESTREL_CHECK(total_q >= 0 && total_k >= 0, kOp, "total_q and total_k must be >= 0, got ", total_q, ", ", total_k);
  const int64_t nqb = (total_q + kB - 1) / kB, nkb = (total_k + kB - 1) / kB;
  std::vector<int32_t> q_ptr{0}, q_kblock, q_kind;
  std::vector<uint32_t> bits, tile(kTileWords);
  for (int64_t qb = 0; qb < nqb; ++qb) {
    for (int64_t kb = 0; kb < nkb; ++kb) {
      std::fill(tile.begin(), tile.end(), 0u);
      const int64_t rows = std::min(kB, total_q - qb * kB), cols = std::min(kB, total_k - kb * kB);
      int64_t count = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          if (visible(qb * kB + r, kb * kB + c)) {
            tile[r * kWords + c / 32] |= 1u << (c % 32);
            ++count;
          }
      if (count == 0) continue;
      q_kblock.push_back(static_cast<int32_t>(kb));
      if (count == rows * cols) {
        q_kind.push_back(BlockMask::kFull);
      } else {
        q_kind.push_back(static_cast<int32_t>(bits.size() / kTileWords));
        bits.insert(bits.end(), tile.begin(), tile.end());
      }
    }
    q_ptr.push_back(static_cast<int32_t>(q_kblock.size()));
  }
  return make_block_mask(total_q, total_k, q_ptr, q_kblock, q_kind, bits);
}

BlockMask block_mask_from_dense(const Tensor& mask) {
  KESTREL_CHECK(mask.defined() && mask.dim() == 2, kOp, "the dense mask must be [total_q, total_k], got ",
                mask.defined() ? mask.str() : std::string("undefined"));
  KESTREL_CHECK(mask.device().is_cpu(), kOp, "the dense mask must be on the CPU, got ", mask.str());
  KESTREL_CHECK(mask.dtype() == DType::Bool || mask.dtype() == DType::U8 || mask.dtype() == DType::I32, kOp,
                "the dense mask must be Bool, U8 or I32, got ", mask.str());
  const Tensor m = mask.contiguous();
  const int64_t tk = m.shape()[1];
  if (m.dtype() == DType::I32) {
    const int32_t* d = m.data<int32_t>();
    return block_mask_from_predicate(m.shape()[0], tk, [&](int64_t i, int64_t j) { return d[i * tk + j] != 0; });
  }
  const uint8_t* d = static_cast<const uint8_t*>(m.data_ptr());
  return block_mask_from_predicate(m.shape()[0], tk, [&](int64_t i, int64_t j) { return d[i * tk + j] != 0; });
}

}  // namespace kestrel

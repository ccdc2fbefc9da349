// Tensor handles: views share storage, strides after permute/narrow/expand, copies with dtype
// conversion, and the allocator's per-tag accounting.
#include <gtest/gtest.h>

#include "kestrel/runtime/memory_trace.h"
#include "kestrel/runtime/tensor.h"
#include "support/numerics.h"

namespace kestrel {
namespace {

TEST(Tensor, ViewsShareStorageAndWriteThrough) {
  Tensor t = Tensor::from_vector(std::vector<float>{0, 1, 2, 3, 4, 5}, {2, 3});
  Tensor tt = t.permute_view({1, 0});
  EXPECT_EQ(tt.shape(), (Shape{3, 2}));
  EXPECT_EQ(tt.strides(), (Strides{1, 3}));
  EXPECT_FALSE(tt.is_contiguous());
  Tensor col = tt.narrow_view(0, 1, 2);  // rows 1..2 of the transpose = columns 1..2 of t
  EXPECT_EQ(col.offset(), 1);
  col.fill_(9.0f);
  EXPECT_EQ(t.to_float_vector(), (std::vector<float>{0, 9, 9, 3, 9, 9}));
  Tensor c = tt.contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.to_float_vector(), (std::vector<float>{0, 3, 9, 9, 9, 9}));
  EXPECT_NE(c.storage(), t.storage());
  EXPECT_EQ(tt.storage(), t.storage());
}

TEST(Tensor, ViewRejectsNonContiguousAndBadShapes) {
  Tensor t = Tensor::zeros({4, 6});
  EXPECT_THROW(t.view({5, 5}), Error);
  EXPECT_EQ(t.view({-1, 3}).shape(), (Shape{8, 3}));
  EXPECT_THROW(t.permute_view({1, 0}).view({24}), Error);
  EXPECT_THROW(t.narrow_view(1, 4, 3), Error);
  EXPECT_THROW(t.permute_view({0, 0}), Error);
}

TEST(Tensor, ExpandAndConvertingCopy) {
  Tensor row = testing::randn({1, 5});
  Tensor e = row.expand_view({3, 5});
  EXPECT_EQ(e.strides()[0], 0);
  Tensor bf = e.to(DType::BF16);
  auto src = row.to_float_vector();
  auto got = bf.to_float_vector();
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 5; ++j) EXPECT_EQ(got[i * 5 + j], static_cast<float>(bf16(src[j])));
  Tensor ints = Tensor::from_vector(std::vector<int64_t>{-3, 7, 1 << 20}, {3});
  EXPECT_EQ(ints.to(DType::F32).to_float_vector(), (std::vector<float>{-3, 7, 1 << 20}));
  EXPECT_EQ(ints.to(DType::I32).to_int_vector(), (std::vector<int64_t>{-3, 7, 1 << 20}));
}

TEST(Tensor, StridedCopyIntoPermutedDestination) {
  Tensor src = testing::randn({3, 4, 5});
  Tensor dst = Tensor::zeros({5, 4, 3}).permute_view({2, 1, 0});
  dst.copy_(src);
  auto a = src.to_float_vector(), b = dst.to_float_vector();
  EXPECT_EQ(a, b);
}

TEST(Memory, TagCountersTrackCurrentAndPeak) {
  MemoryTrace& tr = memory_trace(Device::cpu());
  tr.reset_peaks();
  auto base = tr.snapshot();
  int64_t act0 = base.tags[static_cast<int>(MemoryTag::Activation)].current;
  {
    TagScope scope(MemoryTag::Activation);
    Tensor a = Tensor::empty({1000}, DType::F32);
    {
      Tensor b = Tensor::empty({500}, DType::F32);
      auto s = tr.snapshot();
      EXPECT_EQ(s.tags[static_cast<int>(MemoryTag::Activation)].current - act0, 6000);
    }
    Tensor c = Tensor::empty({100}, DType::BF16);
    auto s = tr.snapshot();
    EXPECT_EQ(s.tags[static_cast<int>(MemoryTag::Activation)].current - act0, 4200);
    EXPECT_GE(s.tags[static_cast<int>(MemoryTag::Activation)].peak - act0, 6000);
  }
  {
    TagScope scope(MemoryTag::Parameter);
    Tensor p = Tensor::empty({10}, DType::F32);
    EXPECT_EQ(p.storage()->tag(), MemoryTag::Parameter);
  }
  EXPECT_EQ(current_memory_tag(), MemoryTag::Temporary);
  auto end = tr.snapshot();
  EXPECT_EQ(end.tags[static_cast<int>(MemoryTag::Activation)].current, act0);
}

TEST(Memory, EventLogRecordsPhases) {
  MemoryTrace tr(Device::cpu());
  tr.set_event_logging(true);
  {
    tr.begin_phase("forward");
    tr.on_alloc(MemoryTag::Activation, 128);
    tr.on_free(MemoryTag::Activation, 128);
    tr.end_phase("forward");
  }
  auto ev = tr.events();
  ASSERT_EQ(ev.size(), 4u);
  EXPECT_EQ(ev[0].kind, MemoryEventKind::PhaseBegin);
  EXPECT_EQ(ev[0].label, "forward");
  EXPECT_EQ(ev[1].in_use_after, 128);
  EXPECT_EQ(ev[2].in_use_after, 0);
}

TEST(Device, ParseAndErrors) {
  EXPECT_EQ(parse_device("cuda:3"), Device::cuda(3));
  EXPECT_EQ(parse_device("cpu"), Device::cpu());
  EXPECT_THROW(parse_device("tpu"), Error);
  EXPECT_THROW(parse_device("cuda:x"), Error);
}

}  // namespace
}  // namespace kestrel

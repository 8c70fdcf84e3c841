// The one planner (plan.h): the Python face's pull rules (PairLayers, PlanPull), the spans
// both faces plan with (PlanSlot, PlanBlocks), their refusals and texts (the Python API's,
// which tests/api and tests/compat check), and that both faces plan the same pull the same way.
#include "plan.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "code_of.h"
#include "errors.h"

namespace {

using datadist::Geometry;
using datadist::LayerRange;
using datadist::Plan;
using datadist::PullSpec;

Geometry Geo(uint32_t tensors, uint64_t units, uint64_t unit_bytes) {
  Geometry g;
  g.num_tensors = tensors;
  g.units = units;
  g.unit_bytes = unit_bytes;
  g.tensor_bytes = units * unit_bytes;
  return g;
}

// The text of the LLM_PARAM_INVALID `fn` fails with ("" when it returns or fails otherwise).
std::string Refusal(const std::function<void()> &fn) {
  try {
    fn();
  } catch (const datadist::Error &e) {
    if (e.code() == llm_datadist::LLM_PARAM_INVALID) return e.what();
    return "code " + std::to_string(e.code());
  }
  return "";
}

LayerRange R(uint64_t start, uint64_t stop) { return {true, start, stop}; }

std::vector<uint32_t> Iota(uint32_t from, uint32_t to) {
  std::vector<uint32_t> v;
  for (uint32_t i = from; i < to; ++i) v.push_back(i);
  return v;
}

// ---- PairLayers: llm_datadist's Python layer rules

TEST(PairLayers, NoRangeIsEveryTensorByIndexAndWhole) {
  Plan p;
  datadist::PairLayers(p, 5, {}, {}, 2);  // 5: no multiple of n needed without a range
  EXPECT_EQ(p.remote_tensors, Iota(0, 5));
  EXPECT_EQ(p.local_tensors, Iota(0, 5));
  EXPECT_TRUE(p.whole);
}

TEST(PairLayers, BothRanges) {
  Plan p;
  datadist::PairLayers(p, 8, R(1, 3), R(2, 4), 2);
  EXPECT_EQ(p.remote_tensors, Iota(2, 6));
  EXPECT_EQ(p.local_tensors, Iota(4, 8));
  EXPECT_FALSE(p.whole);
}

TEST(PairLayers, SourceOnlyMustCoverEveryLocalTensor) {
  Plan p;
  datadist::PairLayers(p, 4, R(3, 5), {}, 2);
  EXPECT_EQ(p.remote_tensors, Iota(6, 10));
  EXPECT_EQ(p.local_tensors, Iota(0, 4));
  EXPECT_EQ(Refusal([&] { datadist::PairLayers(p, 4, R(0, 1), {}, 2); }),
            "src_layer_range (0, 1) covers 2 tensors but the destination has 4");
}

TEST(PairLayers, DestinationOnlyReadsFromLayerZero) {
  Plan p;
  datadist::PairLayers(p, 9, {}, R(1, 3), 3);
  EXPECT_EQ(p.remote_tensors, Iota(0, 6));
  EXPECT_EQ(p.local_tensors, Iota(3, 9));
}

TEST(PairLayers, Refusals) {
  Plan p;
  EXPECT_EQ(Refusal([&] { datadist::PairLayers(p, 4, {}, {}, 0); }), "tensor_num_per_layer must be > 0, got 0");
  EXPECT_EQ(Refusal([&] { datadist::PairLayers(p, 5, R(0, 1), R(0, 1), 2); }),
            "destination num_tensors 5 is not a multiple of tensor_num_per_layer 2");
  EXPECT_EQ(Refusal([&] { datadist::PairLayers(p, 4, R(2, 2), {}, 2); }),
            "src_layer_range must satisfy 0 <= start < stop, got (2, 2)");
  EXPECT_EQ(Refusal([&] { datadist::PairLayers(p, 4, {}, R(1, 3), 2); }),
            "dst_layer_range (1, 3) exceeds the destination's 2 layers");
  EXPECT_EQ(Refusal([&] { datadist::PairLayers(p, 8, R(0, 1), R(0, 2), 2); }),
            "src_layer_range (0, 1) and dst_layer_range (0, 2) differ in length");
  EXPECT_EQ(Refusal([&] { datadist::PairLayers(p, 2, R(uint64_t{1} << 31, (uint64_t{1} << 31) + 1), R(0, 1), 2); }),
            "src_layer_range (2147483648, 2147483649) reaches past the largest tensor index");
  // The last tensor index that fits: (2**31 - 1) * 2 + 1 = 2**32 - 1.
  datadist::PairLayers(p, 2, R((uint64_t{1} << 31) - 1, uint64_t{1} << 31), R(0, 1), 2);
  EXPECT_EQ(p.remote_tensors.back(), UINT32_MAX);
}

// ---- PlanSlot: one slot, with offsets and size

TEST(PlanSlot, WholeSlotAndTheRestAfterAnOffset) {
  const Geometry g = Geo(2, 4, 64);
  Plan p;
  datadist::PlanSlot(p, g, 3, -1);
  EXPECT_EQ(p.local_offsets, std::vector<uint64_t>{192});
  EXPECT_EQ(p.remote_offsets, std::vector<uint64_t>{0});
  EXPECT_EQ(p.lengths, std::vector<uint64_t>{64});
  datadist::PlanSlot(p, g, 1, -1, 5, 16);
  EXPECT_EQ(p.local_offsets, std::vector<uint64_t>{80});
  EXPECT_EQ(p.remote_offsets, std::vector<uint64_t>{5});
  EXPECT_EQ(p.lengths, std::vector<uint64_t>{48});
  datadist::PlanSlot(p, g, 1, 8, 0, 56);
  EXPECT_EQ(p.lengths, std::vector<uint64_t>{8});
}

TEST(PlanSlot, Refusals) {
  const Geometry g = Geo(2, 4, 64);
  Plan p;
  EXPECT_EQ(Refusal([&] { datadist::PlanSlot(p, g, 4, -1); }), "batch_index 4 out of range [0, 4)");
  EXPECT_EQ(Refusal([&] { datadist::PlanSlot(p, g, 0, -1, 0, 64); }), "dst offset 64 out of range [0, 64)");
  EXPECT_EQ(Refusal([&] { datadist::PlanSlot(p, g, 0, 9, 0, 56); }),
            "size 9 does not fit the destination slot of 64 bytes after offset 56");
  EXPECT_EQ(Refusal([&] { datadist::PlanSlot(p, g, 0, 0); }),
            "size 0 does not fit the destination slot of 64 bytes after offset 0");
  EXPECT_EQ(Refusal([&] { datadist::PlanSlot(p, g, 0, -2); }),
            "size -2 does not fit the destination slot of 64 bytes after offset 0");
  EXPECT_EQ(Refusal([&] { datadist::PlanSlot(p, g, 0, 8, UINT64_MAX - 7); }),
            "src offset 18446744073709551608 plus size 8 overflows 64 bits");
  datadist::PlanSlot(p, g, 0, 8, UINT64_MAX - 8);  // ends at 2**64 - 1: fits
}

// ---- PlanBlocks: runs adjacent on both sides coalesce

TEST(PlanBlocks, Coalesces) {
  const Geometry g = Geo(2, 16, 32);
  Plan p;
  datadist::PlanBlocks(p, g, {4, 5, 6, 9, 3}, {0, 1, 2, 3, 5});
  EXPECT_EQ(p.remote_offsets, (std::vector<uint64_t>{128, 288, 96}));
  EXPECT_EQ(p.local_offsets, (std::vector<uint64_t>{0, 96, 160}));
  EXPECT_EQ(p.lengths, (std::vector<uint64_t>{96, 32, 32}));
}

TEST(PlanBlocks, RefusalsInThePythonOrder) {
  const Geometry g = Geo(2, 16, 32);
  Plan p;
  EXPECT_EQ(Refusal([&] { datadist::PlanBlocks(p, g, {}, {}); }), "dst_blocks must not be empty");
  EXPECT_EQ(Refusal([&] { datadist::PlanBlocks(p, g, {1}, {1, 2}); }), "src_blocks has 1 entries but dst_blocks has 2");
  // the largest local block is named, before any remote block is looked at
  EXPECT_EQ(Refusal([&] {
              datadist::PlanBlocks(p, g, {UINT64_MAX, 0, 0}, {16, 3, 20});
            }),
            "dst block 20 out of range: the cache has 16 blocks");
  EXPECT_EQ(Refusal([&] {
              datadist::PlanBlocks(p, g, {0, (UINT64_MAX / 32)}, {0, 1});
            }),
            "src block 576460752303423487 is out of range: its offset (32 bytes a block) overflows 64 bits");
  datadist::PlanBlocks(p, g, {UINT64_MAX / 32 - 1}, {0});  // its extent ends at 2**64 - 32: fits
  EXPECT_EQ(p.remote_offsets.back(), (UINT64_MAX / 32 - 1) * 32);
}

// ---- PlanPull: a Python-face pull as a whole

TEST(PlanPull, SlotIntoBlocksSplitsTheSlotInOrder) {
  const Geometry g = Geo(4, 8, 16);
  PullSpec s;
  s.kind = PullSpec::kSlotToBlocks;
  s.dst_blocks = {5, 6, 1};
  Plan p;
  datadist::PlanPull(p, g, s);
  EXPECT_EQ(p.remote_offsets, (std::vector<uint64_t>{0, 32}));
  EXPECT_EQ(p.local_offsets, (std::vector<uint64_t>{80, 16}));
  EXPECT_EQ(p.lengths, (std::vector<uint64_t>{32, 16}));
  EXPECT_TRUE(p.whole);
  s.dst_blocks = {8};
  EXPECT_EQ(Refusal([&] { datadist::PlanPull(p, g, s); }), "dst block 8 out of range: the cache has 8 blocks");
}

TEST(PlanPull, LayersAreCheckedBeforeSpans) {
  const Geometry g = Geo(3, 8, 16);
  PullSpec s;
  s.kind = PullSpec::kSlot;
  s.batch_index = 99;  // also wrong, but the layers are refused first, as in Python
  s.src_layers = R(0, 1);
  Plan p;
  EXPECT_EQ(Refusal([&] { datadist::PlanPull(p, g, s); }),
            "destination num_tensors 3 is not a multiple of tensor_num_per_layer 2");
}

// ---- PlanPush: a Python-face push, its tensor pairs given

TEST(PlanPush, SlotAndBlocks) {
  const Geometry g = Geo(4, 8, 16);
  datadist::PushSpec s;  // local layer 1 (tensors 2, 3) into remote layer 3 (tensors 6, 7)
  s.remote_first = 6;
  s.local_first = 2;
  s.count = 2;
  s.batch_index = 5;
  Plan p;
  datadist::PlanPush(p, g, s);
  EXPECT_EQ(p.remote_tensors, Iota(6, 8));
  EXPECT_EQ(p.local_tensors, Iota(2, 4));
  EXPECT_EQ(p.local_offsets, std::vector<uint64_t>{80});
  EXPECT_EQ(p.lengths, std::vector<uint64_t>{16});
  EXPECT_FALSE(p.whole);
  s.blocks = true;
  s.src_blocks = {1, 2, 7};  // local
  s.dst_blocks = {4, 5, 0};  // remote
  datadist::PlanPush(p, g, s);
  EXPECT_EQ(p.remote_offsets, (std::vector<uint64_t>{64, 0}));
  EXPECT_EQ(p.local_offsets, (std::vector<uint64_t>{16, 112}));
  EXPECT_EQ(p.lengths, (std::vector<uint64_t>{32, 16}));
  s.src_blocks = {8};  // the local block is named "dst" (the planner's pull-side name), as in Python
  s.dst_blocks = {0};
  EXPECT_EQ(Refusal([&] { datadist::PlanPush(p, g, s); }), "dst block 8 out of range: the cache has 8 blocks");
  s.remote_first = UINT32_MAX;
  EXPECT_EQ(Refusal([&] { datadist::PlanPush(p, g, s); }),
            "the push's tensor pairs reach past the largest tensor index");
}

// ---- both faces: the C++ API's pulls (llm_datadist.cc: CheckExtParam, PairTensors with
// CANN's inclusive ranges, then PlanSlot / PlanBlocks) and the Python face's (PlanPull with
// half-open ranges) plan the same request identically.

void ExpectSame(const Plan &a, const Plan &b) {
  EXPECT_EQ(a.remote_tensors, b.remote_tensors);
  EXPECT_EQ(a.local_tensors, b.local_tensors);
  EXPECT_EQ(a.remote_offsets, b.remote_offsets);
  EXPECT_EQ(a.local_offsets, b.local_offsets);
  EXPECT_EQ(a.lengths, b.lengths);
  EXPECT_EQ(a.whole, b.whole);
}

TEST(BothFaces, LayerRangedBlockPullPlansTheSame) {
  const Geometry g = Geo(8, 16, 64);
  llm_datadist::KvCacheExtParam ext;
  ext.src_layer_range = {1, 2};  // CANN: inclusive
  ext.dst_layer_range = {0, 1};
  ext.tensor_num_per_layer = 2;
  const std::vector<uint64_t> src = {7, 8, 9, 2}, dst = {0, 1, 2, 9};
  Plan cpp;  // as llm_datadist.cc's PullBlocks plans
  datadist::CheckExtParam(ext, false);
  datadist::PairTensors(cpp, g.num_tensors, ext, false);
  datadist::PlanBlocks(cpp, g, src, dst);
  PullSpec s;  // as CacheManager.pull_blocks states it (range(1, 3), range(0, 2))
  s.kind = PullSpec::kBlocks;
  s.src_blocks = src;
  s.dst_blocks = dst;
  s.src_layers = R(1, 3);
  s.dst_layers = R(0, 2);
  Plan py;
  datadist::PlanPull(py, g, s);
  ExpectSame(cpp, py);
  EXPECT_EQ(py.remote_tensors, Iota(2, 6));
  EXPECT_EQ(py.lengths, (std::vector<uint64_t>{192, 64}));
}

TEST(BothFaces, WholeSlotPullPlansTheSame) {
  const Geometry g = Geo(4, 3, 128);
  llm_datadist::KvCacheExtParam ext;  // {-1, -1}: every tensor
  Plan cpp;                           // as llm_datadist.cc's PullCache plans
  datadist::CheckExtParam(ext, false);
  datadist::PairTensors(cpp, g.num_tensors, ext, false);
  datadist::PlanSlot(cpp, g, 2, 100);
  PullSpec s;  // CacheManager.pull_cache(key, cache, batch_index=2, size=100)
  s.batch_index = 2;
  s.size = 100;
  Plan py;
  datadist::PlanPull(py, g, s);
  ExpectSame(cpp, py);
  EXPECT_TRUE(py.whole);
  EXPECT_EQ(py.local_offsets, std::vector<uint64_t>{256});
}

TEST(BothFaces, SlotIntoBlocksPlansTheSame) {
  const Geometry g = Geo(2, 8, 32);
  llm_datadist::KvCacheExtParam ext;
  const std::vector<uint64_t> dst = {3, 4, 0};
  Plan cpp;  // llm_datadist.cc's PullBlocks with no src_blocks: remote blocks 0, 1, ...
  datadist::PairTensors(cpp, g.num_tensors, ext, false);
  datadist::PlanBlocks(cpp, g, {0, 1, 2}, dst);
  PullSpec s;  // CacheManager.pull_blocks(CacheKeyByIdAndIndex(...), cache, [], dst)
  s.kind = PullSpec::kSlotToBlocks;
  s.dst_blocks = dst;
  Plan py;
  datadist::PlanPull(py, g, s);
  ExpectSame(cpp, py);
}

TEST(BothFaces, LayerRangedBlockPushPlansTheSame) {
  const Geometry g = Geo(4, 16, 64);
  llm_datadist::KvCacheExtParam ext;
  ext.src_layer_range = {1, 1};  // CANN: local layer 1 ...
  ext.dst_layer_range = {0, 0};  // ... into remote layer 0
  ext.tensor_num_per_layer = 2;
  const std::vector<uint64_t> src = {3, 4}, dst = {9, 10};
  Plan cpp;  // as llm_datadist.cc's PushKvBlocks plans
  datadist::CheckExtParam(ext, true);
  datadist::PairTensors(cpp, g.num_tensors, ext, true);
  datadist::PlanBlocks(cpp, g, dst, src);
  datadist::PushSpec s;  // CacheManager.push_blocks(..., src_layer_range=range(1, 2), dst_layer_range=range(0, 1))
  s.blocks = true;
  s.src_blocks = src;
  s.dst_blocks = dst;
  s.remote_first = 0;
  s.local_first = 2;
  s.count = 2;
  Plan py;
  datadist::PlanPush(py, g, s);
  ExpectSame(cpp, py);
}

}  // namespace

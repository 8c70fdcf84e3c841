// The one planner (plan.h): the Python face's pull rules (PairLayers, PlanPull), the spans
// both faces plan with (PlanSlot, PlanBlocks), the local copies' (PlanSlotCopy, PlanBlockCopy),
// their refusals and texts (the Python API's, which tests/api and tests/compat check), and that
// both faces plan the same pull, and refuse and make the same local copy, the same way.
#include "plan.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "code_of.h"
#include "errors.h"
#include "session.h"
#include "test_util.h"

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
  const datadist::Blocks none;
  EXPECT_EQ(Refusal([&] { datadist::PlanBlocks(p, g, none, none); }), "dst_blocks must not be empty");
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
  const std::vector<uint64_t> dst = {5, 6, 1}, past = {8};  // the spec's lists are views of these
  s.dst_blocks = dst;
  Plan p;
  datadist::PlanPull(p, g, s);
  EXPECT_EQ(p.remote_offsets, (std::vector<uint64_t>{0, 32}));
  EXPECT_EQ(p.local_offsets, (std::vector<uint64_t>{80, 16}));
  EXPECT_EQ(p.lengths, (std::vector<uint64_t>{32, 16}));
  EXPECT_TRUE(p.whole);
  s.dst_blocks = past;
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
  const std::vector<uint64_t> local = {1, 2, 7}, remote = {4, 5, 0}, past = {8}, first = {0};
  s.src_blocks = local;
  s.dst_blocks = remote;
  datadist::PlanPush(p, g, s);
  EXPECT_EQ(p.remote_offsets, (std::vector<uint64_t>{64, 0}));
  EXPECT_EQ(p.local_offsets, (std::vector<uint64_t>{16, 112}));
  EXPECT_EQ(p.lengths, (std::vector<uint64_t>{32, 16}));
  s.src_blocks = past;  // the local block is named "dst" (the planner's pull-side name), as in Python
  s.dst_blocks = first;
  EXPECT_EQ(Refusal([&] { datadist::PlanPush(p, g, s); }), "dst block 8 out of range: the cache has 8 blocks");
  s.remote_first = UINT32_MAX;
  EXPECT_EQ(Refusal([&] { datadist::PlanPush(p, g, s); }),
            "the push's tensor pairs reach past the largest tensor index");
}

// ---- local copies: PlanSlotCopy / PlanBlockCopy (the Python API's rules and texts)

TEST(PlanSlotCopy, SpansAbsoluteInTheSourceAndEveryTensor) {
  Plan p;
  datadist::PlanSlotCopy(p, Geo(3, 4, 64), Geo(3, 2, 64), 3, 1, 8, 16);
  EXPECT_EQ(p.remote_offsets, std::vector<uint64_t>{3 * 64 + 8});
  EXPECT_EQ(p.local_offsets, std::vector<uint64_t>{64 + 8});
  EXPECT_EQ(p.lengths, std::vector<uint64_t>{16});
  EXPECT_EQ(p.remote_tensors, Iota(0, 3));
  EXPECT_EQ(p.local_tensors, Iota(0, 3));
  EXPECT_FALSE(p.whole);
  // size -1: the rest of the source slot after the offset (which must fit the destination's)
  datadist::PlanSlotCopy(p, Geo(1, 1, 64), Geo(1, 1, 128), 0, 0, 10, -1);
  EXPECT_EQ(p.lengths, std::vector<uint64_t>{54});
}

TEST(PlanSlotCopy, RefusalsInThePythonOrder) {
  const Geometry src = Geo(2, 4, 64), dst = Geo(2, 2, 32);
  Plan p;
  EXPECT_EQ(Refusal([&] { datadist::PlanSlotCopy(p, Geo(2, 1, 64), Geo(3, 1, 64), 9, 9, 0, -1); }),
            "src has 2 tensors but dst has 3 tensors");
  EXPECT_EQ(Refusal([&] { datadist::PlanSlotCopy(p, src, dst, 4, 2, 0, -1); }),
            "src_batch_index 4 out of range [0, 4)");
  EXPECT_EQ(Refusal([&] { datadist::PlanSlotCopy(p, src, dst, 0, 2, 99, -1); }),
            "dst_batch_index 2 out of range [0, 2)");
  EXPECT_EQ(Refusal([&] { datadist::PlanSlotCopy(p, src, dst, 0, 0, 64, -1); }),
            "offset 64 out of range of the src batch stride 64");
  EXPECT_EQ(Refusal([&] { datadist::PlanSlotCopy(p, src, dst, 0, 0, 32, -1); }),
            "offset 32 out of range of the dst batch stride 32");
  // -1 is the rest of the source slot: too much for the destination's
  EXPECT_EQ(Refusal([&] { datadist::PlanSlotCopy(p, src, dst, 0, 0, 8, -1); }),
            "size 56 does not fit the dst batch stride 32 after offset 8");
  EXPECT_EQ(Refusal([&] { datadist::PlanSlotCopy(p, src, dst, 0, 0, 0, 0); }),
            "size 0 does not fit the src batch stride 64 after offset 0");
  EXPECT_EQ(Refusal([&] { datadist::PlanSlotCopy(p, dst, src, 0, 0, 30, 3); }),
            "size 3 does not fit the src batch stride 32 after offset 30");
  datadist::PlanSlotCopy(p, src, dst, 3, 1, 8, 24);  // fits both
  EXPECT_EQ(p.lengths, std::vector<uint64_t>{24});
}

TEST(PlanBlockCopy, CoalescesRunsAdjacentOnBothSides) {
  const Geometry g = Geo(2, 16, 32);
  Plan p;
  datadist::PlanBlockCopy(p, g, g, {0, 1, 2, 9}, {5, 6, 7, 3}, false);
  EXPECT_EQ(p.remote_offsets, (std::vector<uint64_t>{0, 9 * 32}));
  EXPECT_EQ(p.local_offsets, (std::vector<uint64_t>{5 * 32, 3 * 32}));
  EXPECT_EQ(p.lengths, (std::vector<uint64_t>{3 * 32, 32}));
  EXPECT_EQ(p.local_tensors, Iota(0, 2));
  // within one cache, blocks that are read or written but not both
  datadist::PlanBlockCopy(p, g, g, {0, 1}, {2, 3}, true);
  EXPECT_EQ(p.lengths, std::vector<uint64_t>{64});
}

TEST(PlanBlockCopy, RefusalsInThePythonOrder) {
  const Geometry g = Geo(1, 16, 32);
  Plan p;
  EXPECT_EQ(Refusal([&] { datadist::PlanBlockCopy(p, g, Geo(2, 16, 32), {99}, {99}, false); }),
            "src has 1 tensors but dst has 2 tensors");
  Geometry half = Geo(1, 32, 16);
  half.layout = (uint64_t{ge::DT_FLOAT16} + 1) << 32;
  Geometry whole = g;
  whole.layout = half.layout;
  EXPECT_EQ(Refusal([&] { datadist::PlanBlockCopy(p, whole, half, {}, {}, false); }),
            "block sizes differ: the source's blocks hold 16 DT_FLOAT16 elements (32 bytes), the destination's "
            "8 DT_FLOAT16 elements (16 bytes)");
  EXPECT_EQ(Refusal([&] { datadist::PlanBlockCopy(p, g, g, {}, {}, false); }), "no blocks to copy");
  EXPECT_EQ(Refusal([&] {
              datadist::PlanBlockCopy(p, g, g, {16, 3}, {99, 99}, false);
            }),
            "src block 16 out of range: the cache has 16 blocks");
  EXPECT_EQ(Refusal([&] {
              datadist::PlanBlockCopy(p, g, g, {0, 1}, {99, 99}, false);
            }),
            "a destination block is listed more than once");
  EXPECT_EQ(Refusal([&] {
              datadist::PlanBlockCopy(p, g, g, {5, 1, 9}, {7, 9, 5}, true);
            }),
            "block 5 is both a source and a destination");
  EXPECT_EQ(Refusal([&] {
              datadist::PlanBlockCopy(p, g, g, {0, 1}, {3}, false);
            }),
            "src_blocks has 2 entries but dst_blocks has 1");
  EXPECT_EQ(Refusal([&] {
              datadist::PlanBlockCopy(p, g, g, {0, 1}, {3, 16}, false);
            }),
            "dst block 16 out of range: the cache has 16 blocks");
  datadist::PlanBlockCopy(p, g, g, {5, 1, 9}, {7, 9, 5}, false);  // two caches: no overlap rule
  EXPECT_EQ(p.lengths.size(), 3U);
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

// ---- both faces' local copies: the C++ API's CopyKvCache / CopyKvBlocks (llm_datadist.cc)
// and the Python binding's copy_slot / copy_blocks (Session::CopySlot / CopyBlocks with the
// caches' ids) refuse the same copies with the same words and copy the same bytes.

struct CopyFaces {
  // The C++ face: an initialized LlmDataDist and caches registered through it.
  llm_datadist::LlmDataDist dd{1, llm_datadist::LlmRole::kDecoder};
  // The Python face's core: a session whose registry holds caches of the same shapes.
  datadist::Session session{2, 0, 1};
  std::vector<std::unique_ptr<ddtest::HostCache>> cpp, py;
  std::vector<datadist::CopySide> sides;

  CopyFaces() { EXPECT_EQ(dd.Initialize(ddtest::Options()), llm_datadist::LLM_SUCCESS); }
  ~CopyFaces() { dd.Finalize(); }
  // Cache `i` of both faces (in the order added), same shape, same contents.
  size_t Add(uint32_t tensors, std::vector<int64_t> shape, uint32_t seed) {
    cpp.emplace_back(new ddtest::HostCache(tensors, shape));
    py.emplace_back(new ddtest::HostCache(tensors, shape));
    cpp.back()->Fill(seed);
    py.back()->Fill(seed);
    EXPECT_EQ(cpp.back()->Register(dd), llm_datadist::LLM_SUCCESS);
    datadist::CopySide side;
    side.cache_id = session.engine().registry().Add(py.back()->desc, py.back()->addrs, {});
    sides.push_back(side);
    return cpp.size() - 1;
  }
  // What the C++ face said: "" on success, else the planner's words after its prefix.
  static std::string Said(llm_datadist::Status s, const std::string &func) {
    if (s == llm_datadist::LLM_SUCCESS) return "";
    const std::string prefix = func + " failed (LLM_PARAM_INVALID, 0x5010B005): ";
    const std::string text = llm_datadist::GetLastErrorMessage();
    if (text.compare(0, prefix.size(), prefix) != 0) return "unexpected: " + text;
    return text.substr(prefix.size());
  }
  bool SameBytes() {
    for (size_t c = 0; c < cpp.size(); ++c)
      for (size_t t = 0; t < cpp[c]->mem.size(); ++t)
        if (std::memcmp(cpp[c]->T(t), py[c]->T(t), cpp[c]->bytes) != 0) return false;
    return true;
  }
};

TEST(BothFaces, SlotCopiesRefuseAndCopyTheSame) {
  CopyFaces f;
  const size_t a = f.Add(2, {4, 64}, 1), b = f.Add(2, {2, 32}, 2), three = f.Add(3, {2, 32}, 3);
  struct Case {
    size_t src, dst;
    uint32_t src_batch, dst_batch;
    uint64_t offset;
    int64_t size;
    const char *text;  // "" for a copy that is made
  };
  const Case cases[] = {
      {a, b, 3, 1, 8, 24, ""},
      {a, b, 0, 0, 8, -1, "size 56 does not fit the dst batch stride 32 after offset 8"},
      {b, a, 1, 2, 0, -1, ""},
      {a, three, 0, 0, 0, -1, "src has 2 tensors but dst has 3 tensors"},
      {a, b, 4, 0, 0, -1, "src_batch_index 4 out of range [0, 4)"},
      {a, b, 0, 2, 0, -1, "dst_batch_index 2 out of range [0, 2)"},
      {a, b, 0, 0, 32, 1, "offset 32 out of range of the dst batch stride 32"},
      {a, b, 0, 0, 4, 0, "size 0 does not fit the src batch stride 64 after offset 4"},
      {a, a, 2, 0, 0, -1, ""},  // one slot onto another of the same cache
  };
  for (const Case &c : cases) {
    const std::string py = Refusal(
        [&] { f.session.CopySlot(f.sides[c.src], f.sides[c.dst], c.src_batch, c.dst_batch, c.offset, c.size); });
    const std::string cpp = CopyFaces::Said(
        f.dd.CopyKvCache(f.cpp[c.src]->cache, f.cpp[c.dst]->cache, c.src_batch, c.dst_batch, c.offset, c.size),
        "CopyKvCache");
    EXPECT_EQ(py, c.text);
    EXPECT_EQ(cpp, c.text);
    EXPECT_TRUE(f.SameBytes()) << c.text;
  }
  // and the copies made are the ones asked for: a's slot 3 from byte 8 in b's slot 1
  EXPECT_EQ(std::memcmp(f.py[b]->T(1) + 32 + 8, f.py[a]->T(1) + 3 * 64 + 8, 24), 0);
}

TEST(BothFaces, BlockCopiesRefuseAndCopyTheSame) {
  CopyFaces f;
  const size_t a = f.Add(2, {8, 16}, 4), b = f.Add(2, {8, 16}, 5), small = f.Add(2, {8, 8}, 6);
  struct Case {
    size_t src, dst;
    std::vector<uint64_t> src_blocks;
    std::vector<std::vector<uint64_t>> lists;  // the C++ face's; the Python face's pairs are these in order
    const char *text;
  };
  const Case cases[] = {
      {a, b, {0, 1, 2}, {{5, 6, 7}, {0, 1, 2}}, ""},
      {a, b, {0, 1}, {{2, 3}, {3, 4}}, "a destination block is listed more than once"},
      {a, a, {0, 1, 2}, {{1, 2, 3}}, "block 1 is both a source and a destination"},
      {a, a, {0, 1}, {{4, 5}}, ""},
      {a, b, {8}, {{0}}, "src block 8 out of range: the cache has 8 blocks"},
      {a, b, {0}, {{8}}, "dst block 8 out of range: the cache has 8 blocks"},
      {a,
       small,
       {0},
       {{0}},
       "block sizes differ: the source's blocks hold 16 DT_UINT8 elements (16 bytes), "
       "the destination's 8 DT_UINT8 elements (8 bytes)"},
      {a, b, {}, {}, "no blocks to copy"},
  };
  for (const Case &c : cases) {
    std::vector<uint64_t> from, to;
    for (const auto &list : c.lists) {
      from.insert(from.end(), c.src_blocks.begin(), c.src_blocks.end());
      to.insert(to.end(), list.begin(), list.end());
    }
    const std::string py = Refusal([&] { f.session.CopyBlocks(f.sides[c.src], f.sides[c.dst], from, to); });
    const std::string cpp = CopyFaces::Said(
        f.dd.CopyKvBlocks(f.cpp[c.src]->cache, f.cpp[c.dst]->cache, c.src_blocks, c.lists), "CopyKvBlocks");
    EXPECT_EQ(py, c.text);
    EXPECT_EQ(cpp, c.text);
    EXPECT_TRUE(f.SameBytes()) << c.text;
  }
  EXPECT_EQ(std::memcmp(f.py[b]->T(0) + 5 * 16, f.py[a]->T(0), 3 * 16), 0);
  // a destination list of another length than src_blocks is the C++ face's own translation
  EXPECT_EQ(f.dd.CopyKvBlocks(f.cpp[a]->cache, f.cpp[b]->cache, {0, 1}, {{2}}), llm_datadist::LLM_PARAM_INVALID);
}

}  // namespace

// ---- transfer_cache_async's layer pushes: PlanLayerSpans, LayerPushView, CheckAddressSpans
// and Session::PrepareLayerPushes (the Python face's texts: tests/api/test_transfer_async.py)

namespace {

using datadist::LayerPushSpec;

// A LayerPushSpec with the block lists its views name: moved, a vector keeps its buffer (and
// the views stay good); never copied.
struct OwnedSpec {
  std::vector<uint64_t> src, dst;
  LayerPushSpec spec;
  OwnedSpec(std::vector<uint64_t> s, std::vector<uint64_t> d) : src(std::move(s)), dst(std::move(d)) {
    spec.src_blocks = src;
    spec.dst_blocks = dst;
  }
  OwnedSpec(OwnedSpec &&) = default;
  OwnedSpec &operator=(OwnedSpec &&) = default;
  operator const LayerPushSpec &() const { return spec; }  // NOLINT: implicit, for the calls below
};

OwnedSpec Spec(LayerPushSpec::Kind kind, uint64_t unit, std::vector<uint64_t> src, std::vector<uint64_t> dst,
               uint64_t dst_block_bytes) {
  OwnedSpec s(std::move(src), std::move(dst));
  s.spec.kind = kind;
  s.spec.src_unit = unit;
  s.spec.dst_block_bytes = dst_block_bytes;
  return s;
}

using U64s = std::vector<uint64_t>;

}  // namespace

TEST(PlanLayerSpans, SlotIsTheWholeSlot) {
  const Geometry g = Geo(2, 3, 100);
  Plan p;
  datadist::PlanLayerSpans(p, g, Spec(LayerPushSpec::kSlot, 1, {}, {}, 0));
  EXPECT_EQ(p.remote_offsets, U64s{0});
  EXPECT_EQ(p.local_offsets, U64s{100});
  EXPECT_EQ(p.lengths, U64s{100});
  EXPECT_EQ(Refusal([&] { datadist::PlanLayerSpans(p, g, Spec(LayerPushSpec::kSlot, 3, {}, {}, 0)); }),
            "src_batch_index 3 out of range [0, 3)");
}

TEST(PlanLayerSpans, SlotCutIntoBlocksCoalescesAndEndsShort) {
  const Geometry g = Geo(2, 3, 100);
  Plan p;
  // chunks [0,40) [40,80) [80,100) of slot 1; blocks 5 and 6 are adjacent on both sides
  datadist::PlanLayerSpans(p, g, Spec(LayerPushSpec::kSlotToBlocks, 1, {}, {5, 6, 0}, 40));
  EXPECT_EQ(p.remote_offsets, (U64s{200, 0}));
  EXPECT_EQ(p.local_offsets, (U64s{100, 180}));
  EXPECT_EQ(p.lengths, (U64s{80, 20}));
  const auto refusal = [&](uint64_t unit, U64s dst, uint64_t bb) {
    return Refusal([&] { datadist::PlanLayerSpans(p, g, Spec(LayerPushSpec::kSlotToBlocks, unit, {}, dst, bb)); });
  };
  EXPECT_EQ(refusal(3, {0}, 40), "src_batch_index 3 out of range [0, 3)");
  EXPECT_EQ(refusal(0, {0}, 0), "dst_block_memory_size must be > 0 for a transfer into blocks");
  EXPECT_EQ(refusal(0, {0, 1, 2}, 50), "3 destination blocks of 50 bytes do not fit a source slot of 100 bytes");
  EXPECT_EQ(refusal(0, {}, 50), "0 destination blocks of 50 bytes do not fit a source slot of 100 bytes");
  // (3 - 1) * 2**63 wraps to 0 in 64 bits: still refused
  EXPECT_EQ(refusal(0, {0, 1, 2}, uint64_t{1} << 63),
            "3 destination blocks of 9223372036854775808 bytes do not fit a source slot of 100 bytes");
  EXPECT_EQ(refusal(0, {uint64_t{1} << 63}, 64),
            "dst block 9223372036854775808 is out of range: its offset (64 bytes a block) overflows 64 bits");
}

TEST(PlanLayerSpans, BlocksIntoBlocksOfTheirOwnSize) {
  const Geometry g = Geo(1, 4, 16);
  Plan p;
  // 0 -> 2 and 1 -> 3 adjacent on both sides; 3 -> 7 alone
  datadist::PlanLayerSpans(p, g, Spec(LayerPushSpec::kBlocks, 0, {0, 1, 3}, {2, 3, 7}, 0));
  EXPECT_EQ(p.remote_offsets, (U64s{32, 112}));
  EXPECT_EQ(p.local_offsets, (U64s{0, 48}));
  EXPECT_EQ(p.lengths, (U64s{32, 16}));
  // larger destination blocks: a source block at the start of each, never adjacent
  datadist::PlanLayerSpans(p, g, Spec(LayerPushSpec::kBlocks, 0, {0, 1}, {2, 3}, 32));
  EXPECT_EQ(p.remote_offsets, (U64s{64, 96}));
  EXPECT_EQ(p.local_offsets, (U64s{0, 16}));
  EXPECT_EQ(p.lengths, (U64s{16, 16}));
  const auto refusal = [&](U64s src, U64s dst, uint64_t bb) {
    return Refusal([&] { datadist::PlanLayerSpans(p, g, Spec(LayerPushSpec::kBlocks, 0, src, dst, bb)); });
  };
  EXPECT_EQ(refusal({}, {}, 0),
            "src_block_indices (0) and dst_block_indices (0) must be non-empty and of the same length");
  EXPECT_EQ(refusal({0}, {0, 1}, 0),
            "src_block_indices (1) and dst_block_indices (2) must be non-empty and of the same length");
  EXPECT_EQ(refusal({1, 4}, {0, 1}, 0), "src block 4 out of range [0, 4)");
  EXPECT_EQ(refusal({0}, {0}, 8), "dst_block_memory_size 8 is smaller than a source block (16 bytes)");
  EXPECT_EQ(refusal({0}, {uint64_t{1} << 60}, 0),
            "dst block 1152921504606846976 is out of range: its offset (16 bytes a block) overflows 64 bits");
}

TEST(LayerPushView, ABlocksCacheWithoutSourceBlocksIsContiguous) {
  const Geometry g = Geo(2, 4, 16);
  // kSlot: a slot is a block (the original's batch of one block)
  const Geometry slots = datadist::LayerPushView(g, true, LayerPushSpec::kSlot);
  EXPECT_EQ(slots.units, 4u);
  EXPECT_EQ(slots.unit_bytes, 16u);
  // kSlotToBlocks: one slot, the whole tensor
  const Geometry whole = datadist::LayerPushView(g, true, LayerPushSpec::kSlotToBlocks);
  EXPECT_EQ(whole.units, 1u);
  EXPECT_EQ(whole.unit_bytes, 64u);
  EXPECT_EQ(datadist::LayerPushView(g, false, LayerPushSpec::kSlotToBlocks).units, 4u);
  EXPECT_EQ(Refusal([&] { datadist::LayerPushView(g, false, LayerPushSpec::kBlocks); }),
            "src_block_indices need a blocks cache source");
}

TEST(CheckAddressSpans, ASpanEndingPast64BitsIsRefused) {
  Plan p;
  p.remote_offsets = {200, 0};
  p.local_offsets = {0, 280};
  p.lengths = {80, 20};
  datadist::CheckAddressSpans(p, UINT64_MAX - 280);  // the last span ends at 2**64 - 1
  EXPECT_EQ(Refusal([&] { datadist::CheckAddressSpans(p, UINT64_MAX - 279); }),
            "dst address 0xfffffffffffffee8 plus a span offset overflows 64 bits");
  EXPECT_EQ(Refusal([&] { datadist::CheckAddressSpans(p, UINT64_MAX); }),
            "dst address 0xffffffffffffffff plus a span offset overflows 64 bits");
}

TEST(PrepareLayerPushes, OneCallPerLayerByKeyAndPerTensorByAddress) {
  datadist::Session session{1, 0, 1};
  ddtest::HostCache cache(6, {4, 16});  // 3 layers of (K, V), 4 blocks of 16 bytes
  datadist::CacheOptions opts;
  opts.blocks = true;
  session.engine().registry().Add(7, cache.desc, cache.addrs, opts);
  datadist::wire::Request req;
  req.kind = 3;
  req.b = 9;
  req.unit_bytes = 16;
  OwnedSpec owned = Spec(LayerPushSpec::kBlocks, 0, {0, 1}, {2, 3}, 0);
  LayerPushSpec &spec = owned.spec;
  spec.src_first = 1;  // source layers 1, 2 into destination layers 4, 5
  spec.dst_first = 4;
  spec.layers = 2;
  auto calls = session.PrepareLayerPushes(5, req, spec, 7);
  ASSERT_EQ(calls.size(), 2u);
  for (size_t k = 0; k < 2; ++k) {
    const datadist::Call &c = *calls[k];
    EXPECT_TRUE(c.write);
    EXPECT_EQ(c.cluster, 5u);
    EXPECT_EQ(c.req.b, 9u);
    EXPECT_EQ(c.req.unit_bytes, 16u);
    EXPECT_EQ(c.req.tensors,
              (std::vector<uint32_t>{static_cast<uint32_t>(8 + 2 * k), static_cast<uint32_t>(9 + 2 * k)}));
    EXPECT_EQ(c.req.offsets, U64s{32});
    EXPECT_EQ(c.req.lengths, U64s{32});
    ASSERT_EQ(c.iov.size(), 2u);  // local tensors 2 + 2k, 3 + 2k, blocks 0..1
    EXPECT_EQ(reinterpret_cast<uint64_t>(c.iov[0].iov_base), cache.addrs[2 + 2 * k]);
    EXPECT_EQ(reinterpret_cast<uint64_t>(c.iov[1].iov_base), cache.addrs[3 + 2 * k]);
    EXPECT_EQ(c.bytes, 64u);
    EXPECT_EQ(c.local_cache, 7);
  }
  // By raw address: the whole tensor's slot (a blocks cache cut into destination blocks is one
  // slot), one call per tensor, the address added to every remote offset.
  req = {};
  owned = Spec(LayerPushSpec::kSlotToBlocks, 0, {}, {1, 0}, 32);
  spec.src_first = 0;
  spec.layers = 2;
  spec.dst_addrs = {0x1000, 0x2000, 0x3000, 0x4000};
  calls = session.PrepareLayerPushes(5, req, spec, 7);
  ASSERT_EQ(calls.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(calls[i]->req.tensors, std::vector<uint32_t>{0});
    EXPECT_EQ(calls[i]->req.offsets, (U64s{0x1000 * (i + 1) + 32, 0x1000 * (i + 1)}));
    EXPECT_EQ(calls[i]->req.lengths, (U64s{32, 32}));
    EXPECT_EQ(reinterpret_cast<uint64_t>(calls[i]->iov[0].iov_base), cache.addrs[i]);
  }
  // Every address is checked before any call is made; the refusals are the planner's.
  spec.dst_addrs[3] = UINT64_MAX - 40;
  EXPECT_EQ(Refusal([&] { session.PrepareLayerPushes(5, req, spec, 7); }),
            "dst address 0xffffffffffffffd7 plus a span offset overflows 64 bits");
  spec.dst_addrs.pop_back();
  EXPECT_EQ(Refusal([&] { session.PrepareLayerPushes(5, req, spec, 7); }), "expect 4 dst_addrs, but got 3");
  spec.dst_addrs.clear();
  spec.dst_first = UINT32_MAX;
  EXPECT_EQ(Refusal([&] { session.PrepareLayerPushes(5, req, spec, 7); }),
            "the layer push's layers reach past the largest tensor index");
  spec.dst_first = 0;
  spec.src_first = 2;  // layers 2 and 3 of a 3-layer cache: the local spans' check
  EXPECT_NE(Refusal([&] { session.PrepareLayerPushes(5, req, spec, 7); }).find("local tensor 6 is out of range"),
            std::string::npos);
  EXPECT_EQ(Refusal([&] { session.PrepareLayerPushes(5, req, spec, 8); }),
            "code " + std::to_string(llm_datadist::LLM_KV_CACHE_NOT_EXIST));
}

// pool.h: the allocator pool caches are carved from, and the registry giving a pool cache's
// pages back itself once nothing holds the cache (Registry::Allocate, Release).
#include "pool.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "code_of.h"
#include "errors.h"
#include "registry.h"
#include "wire.h"

namespace {

using datadist::Geometry;
using datadist::KeyId;
using datadist::Pool;
using datadist::Registry;
using namespace llm_datadist;

constexpr uint64_t kPage = 4096;

using ddtest::CodeOf;

TEST(Pool, FirstFitInWholePagesReusesTheLowestHoleAndCoalesces) {
  auto pool = Pool::Create("datadist-test-pool", 16 * kPage, 12);
  EXPECT_EQ(pool->size(), 16 * kPage);
  EXPECT_EQ(pool->page(), std::max<uint64_t>(kPage, static_cast<uint64_t>(sysconf(_SC_PAGESIZE))));
  auto a = pool->Allocate(1);          // one page
  auto b = pool->Allocate(kPage + 1);  // two
  auto c = pool->Allocate(kPage);
  EXPECT_EQ(a->offset, 0U);
  EXPECT_EQ(b->offset, kPage);
  EXPECT_EQ(c->offset, 3 * kPage);
  EXPECT_EQ(b->addr, pool->base() + kPage);
  EXPECT_EQ(pool->used(), 4 * kPage);
  std::memset(reinterpret_cast<void *>(b->addr), 0xab, b->bytes);  // the memory is ours to write
  b.reset();  // a two-page hole at 1: a one-page allocation takes its start
  auto d = pool->Allocate(kPage);
  EXPECT_EQ(d->offset, kPage);
  a.reset();
  d.reset();  // 0..2 free again, merged with both neighbours: three pages fit at 0
  auto e = pool->Allocate(3 * kPage);
  EXPECT_EQ(e->offset, 0U);
  e.reset();
  c.reset();
  EXPECT_EQ(pool->used(), 0U);
  auto whole = pool->Allocate(16 * kPage);
  EXPECT_EQ(whole->offset, 0U);
}

TEST(Pool, ExhaustionAndFragmentationAreOutOfMemoryAndZeroBytesInvalid) {
  auto pool = Pool::Create("datadist-test-pool", 4 * kPage, 12);
  EXPECT_EQ(CodeOf([&] { pool->Allocate(0); }), LLM_PARAM_INVALID);
  EXPECT_EQ(CodeOf([&] { pool->Allocate(5 * kPage); }), LLM_OUT_OF_MEMORY);
  std::vector<std::shared_ptr<Pool::Allocation>> pages;
  for (int i = 0; i < 4; ++i) pages.push_back(pool->Allocate(kPage));
  pages[0].reset();
  pages[2].reset();  // two free pages, not adjacent
  EXPECT_EQ(CodeOf([&] { pool->Allocate(2 * kPage); }), LLM_OUT_OF_MEMORY);
  EXPECT_EQ(CodeOf([] { Pool::Create("x", 0, 12); }), LLM_PARAM_INVALID);
  EXPECT_EQ(CodeOf([] { Pool::Create("x", kPage, 9); }), LLM_PARAM_INVALID);
  EXPECT_EQ(CodeOf([] { Pool::Create("x", UINT64_MAX, 12); }), LLM_OUT_OF_MEMORY);
}

// Random allocations and frees against a page bitmap with lowest-address first fit (what
// Python's hypothesis model of its pool checked): agreeing with the bitmap shows that every
// free coalesces fully, since two adjacent free runs left apart would refuse what it grants.
TEST(Pool, AgreesWithAPageBitmapOverRandomAllocationsAndFrees) {
  constexpr uint64_t kPages = 24;
  auto pool = Pool::Create("datadist-test-pool", kPages * kPage, 12);
  std::vector<bool> free_pages(kPages, true);
  std::vector<std::shared_ptr<Pool::Allocation>> live;
  std::mt19937 rng(7);
  for (int step = 0; step < 3000; ++step) {
    if (live.empty() || rng() % 2) {
      const uint64_t bytes = 1 + rng() % (8 * kPage);
      const uint64_t need = (bytes + kPage - 1) / kPage;
      int64_t want = -1;
      for (uint64_t i = 0, run = 0; i < kPages; ++i) {
        run = free_pages[i] ? run + 1 : 0;
        if (run == need) {
          want = static_cast<int64_t>(i - need + 1);
          break;
        }
      }
      if (want < 0) {
        ASSERT_EQ(CodeOf([&] { pool->Allocate(bytes); }), LLM_OUT_OF_MEMORY) << step;
        continue;
      }
      auto a = pool->Allocate(bytes);
      ASSERT_EQ(a->offset, static_cast<uint64_t>(want) * kPage) << step;
      for (uint64_t i = 0; i < need; ++i) free_pages[static_cast<uint64_t>(want) + i] = false;
      live.push_back(a);
    } else {
      const size_t k = rng() % live.size();
      for (uint64_t i = 0; i < live[k]->bytes / kPage; ++i) free_pages[live[k]->offset / kPage + i] = true;
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
    uint64_t used = 0;
    for (const auto &a : live) used += a->bytes;
    ASSERT_EQ(pool->used(), used) << step;
  }
}

TEST(Pool, AnAllocationKeepsThePoolMappedAfterThePoolIsDropped) {
  auto pool = Pool::Create("datadist-test-pool", 2 * kPage, 12);
  std::vector<uint64_t> addrs;
  datadist::ShmPlace place;
  auto tensors = pool->AllocateTensors(2, 100, &addrs, &place);
  ASSERT_EQ(addrs.size(), 2U);
  EXPECT_EQ(addrs[1] - addrs[0], kPage);  // each tensor on its own page
  EXPECT_EQ(place.fds, (std::vector<int32_t>{pool->fd(), pool->fd()}));
  EXPECT_EQ(place.offsets, (std::vector<uint64_t>{0, kPage}));
  pool.reset();
  std::memset(reinterpret_cast<void *>(addrs[1]), 1, 100);  // still mapped
  EXPECT_EQ(reinterpret_cast<uint8_t *>(addrs[1])[99], 1);
}

// The registry carves pool caches and gives their pages back itself: at once when nothing
// holds the cache, else when the last key or lease lets go (seen at its next Deallocate,
// UnbindKey or Allocate).
class PoolCaches : public ::testing::Test {
 protected:
  void SetUp() override {
    reg.SetModelMap(true);
    pool = Pool::Create("datadist-test-pool", 8 * kPage, 12);
    reg.SetPool(false, pool);
  }
  int64_t Allocate(std::vector<KeyId> keys = {}) {
    std::vector<uint64_t> slots;
    for (size_t i = 0; i < keys.size(); ++i) slots.push_back(i);
    return reg.Allocate(false, geo, {}, keys, slots, std::nullopt);
  }
  Registry reg;
  std::shared_ptr<Pool> pool;
  Geometry geo{2, 2 * kPage, 2, kPage, 0};  // 2 tensors of 2 slots of a page
};

TEST_F(PoolCaches, DeallocateGivesThePagesBackAtOnceWhenNothingHoldsTheCache) {
  const int64_t id = Allocate();
  EXPECT_EQ(pool->used(), 4 * kPage);
  const Registry::Info info = reg.Describe(id);
  EXPECT_TRUE(info.opts.allocated);
  EXPECT_EQ(info.addrs[0], pool->base());
  reg.Deallocate(id, false);
  EXPECT_EQ(pool->used(), 0U);
  EXPECT_EQ(reg.Released(), std::vector<int64_t>{id});
}

TEST_F(PoolCaches, AKeyOrATransferKeepsThePagesUntilItLetsGo) {
  const int64_t id = Allocate({{7, 0, false}});
  reg.Deallocate(id, false);
  EXPECT_EQ(pool->used(), 4 * kPage);  // the key still serves it
  reg.UnbindKey({7, 0, false});
  EXPECT_EQ(pool->used(), 0U);  // released by the registry, nobody polled
  const int64_t held = Allocate();
  auto lease = reg.Hold(held);
  EXPECT_EQ(CodeOf([&] { reg.Remove(held, false, 0); }), LLM_PARAM_INVALID);  // allocated, not registered
  reg.Deallocate(held, false);
  EXPECT_EQ(pool->used(), 4 * kPage);  // a local transfer holds it
  lease.reset();
  const int64_t next = Allocate();  // released first: the pages are reused
  EXPECT_EQ(reg.Describe(next).addrs[0], pool->base());
  EXPECT_EQ(pool->used(), 4 * kPage);
}

TEST_F(PoolCaches, NoPoolABadKeyAndAFullPoolAllocateNothing) {
  EXPECT_EQ(CodeOf([&] { reg.Allocate(true, geo, {}, {}, {}, std::nullopt); }), LLM_PARAM_INVALID);
  Allocate({{1, 0, false}});
  EXPECT_EQ(CodeOf([&] { Allocate({{1, 0, false}}); }), LLM_PARAM_INVALID);  // bound already
  EXPECT_EQ(pool->used(), 4 * kPage);
  Allocate();
  EXPECT_EQ(CodeOf([&] { Allocate(); }), LLM_OUT_OF_MEMORY);
  EXPECT_EQ(pool->used(), 8 * kPage);
  EXPECT_EQ(reg.Clear(0), 0);
  EXPECT_EQ(reg.PoolOf(false), nullptr);
  EXPECT_EQ(pool->used(), 0U);
}

}  // namespace

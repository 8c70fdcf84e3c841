// The session (cpp/src/session.h), the seam both faces call, tested directly: unlinking both
// ends, linking and unlinking many clusters at once (one bad address, a thread that cannot
// start), a transfer's request cap and its counting, submit, and local copies.
#include "session.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "code_of.h"
#include "metrics.h"
#include "registry.h"
#include "test_util.h"

namespace {

using datadist::After;
using datadist::Outcome;
using datadist::Peer;
using datadist::Session;
using namespace llm_datadist;

// Cluster ids of this file's own (the metrics are the process's).
constexpr uint64_t kOwner = 9101, kOwner2 = 9102, kReader = 9103, kNobody = 9104;

// An open session listening on the loopback.
std::unique_ptr<Session> Listening(uint64_t id) {
  auto s = std::make_unique<Session>(id, 0, 2);
  s->engine().Open(datadist::EngineOptions{});
  s->engine().Listen("127.0.0.1", 0);
  return s;
}

std::unique_ptr<Session> Opened(uint64_t id) {
  auto s = std::make_unique<Session>(id, 1, 2);
  s->engine().Open(datadist::EngineOptions{});
  return s;
}

Peer At(const Session &s, uint64_t id) { return {id, "127.0.0.1", const_cast<Session &>(s).engine().port()}; }

// Waits up to 5 s for `cond` (a reverse channel's adoption or teardown runs on the peer's
// threads); the test asserts the outcome, not the time.
template <typename F>
bool Eventually(F &&cond) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!cond()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// The process's pull series of `cluster` (op pull), with the "other peers" series (where an id
// counts once the process named the most ids it names, as a whole test run may have):
// transfers, bytes, and the count of `error`. Tests compare it before and after.
struct Count {
  uint64_t transfers = 0, bytes = 0, errors = 0;
};
Count Pulls(uint64_t cluster, const std::string &error, datadist::metrics::Op op = datadist::metrics::Op::kPull) {
  Count c;
  for (const auto &s : datadist::metrics::Snapshot()) {
    if (s.op != op || (s.cluster_id != cluster && s.cluster_id != datadist::metrics::kOtherPeers)) continue;
    c.transfers += s.transfers;
    c.bytes += s.bytes;
    for (const auto &e : s.errors)
      if (e.first == error) c.errors += e.second;
  }
  return c;
}

// A host cache of `blocks` blocks of `block` bytes in each of `tensors` tensors.
struct Blocks {
  Blocks(uint32_t tensors, uint64_t blocks, uint64_t block)
      : cache(tensors, {static_cast<int64_t>(blocks), static_cast<int64_t>(block)}) {}
  ddtest::HostCache cache;
  datadist::Geometry geo() const { return datadist::GeometryOf(cache.desc); }
};

// The C++ face's pull of blocks (llm_datadist.cc PullBlocks): every tensor i <-> i.
datadist::Plan BlockPlan(const datadist::Geometry &local, const std::vector<uint64_t> &remote,
                         const std::vector<uint64_t> &mine) {
  datadist::Plan plan;
  for (uint32_t t = 0; t < local.num_tensors; ++t) {
    plan.remote_tensors.push_back(t);
    plan.local_tensors.push_back(t);
  }
  datadist::PlanBlocks(plan, local, remote, mine);
  return plan;
}

datadist::wire::Request BlockRequest(const datadist::Plan &plan, int64_t cache_id, uint64_t layout) {
  datadist::wire::Request r;
  r.kind = datadist::wire::kCacheId;
  r.a = static_cast<uint64_t>(cache_id);
  r.layout = layout;
  r.tensors = plan.remote_tensors;
  r.offsets = plan.remote_offsets;
  r.lengths = plan.lengths;
  return r;
}

using ddtest::CodeOf;

TEST(Session, UnlinkClosesBothEndsThenNothingIsLeftToUnlink) {
  auto a = Listening(kOwner), b = Listening(kReader);
  ASSERT_EQ(a->engine().Connect(kReader, "127.0.0.1", b->engine().port(), After(5), false, true), kReader);
  ASSERT_EQ(b->engine().Connect(kOwner, "127.0.0.1", a->engine().port(), After(5), false, true), kOwner);
  // a holds both ends for b: the link it made, and b's reverse channel to it
  ASSERT_TRUE(Eventually([&] {
    auto [own, inbound] = a->engine().BothEnds(kReader);
    return own && inbound;
  }));
  a->Unlink(kReader, After(5), false, false);
  auto [own, inbound] = a->engine().BothEnds(kReader);
  EXPECT_FALSE(own);
  EXPECT_FALSE(inbound);
  EXPECT_EQ(CodeOf([&] { a->Unlink(kReader, After(1), false, false); }), LLM_NOT_YET_LINK);
  // b was told (BYE): its end of the link a made (its reverse channel from a) goes too
  EXPECT_TRUE(Eventually([&] {
    for (uint64_t id : b->engine().LinkIds(true))
      if (id == kOwner) return false;
    return true;
  }));
}

TEST(Session, UnlinkManyOfAClusterNeverLinkedFollowsCannsRules) {
  auto a = Listening(kOwner), b = Opened(kReader);
  const uint16_t dead = ddtest::FreePort();
  datadist::UnlinkRule plain, forced, hixl;
  forced.force = true;
  hixl.hixl = true;
  // Without force CANN dials the listener to tell it: one answers (success), one does not.
  auto got = b->UnlinkMany({At(*a, kOwner), {kNobody, "127.0.0.1", dead}, {kNobody, "", 0}}, After(2), plain);
  ASSERT_EQ(got.size(), 3U);
  EXPECT_EQ(got[0].code, LLM_SUCCESS) << got[0].why;
  EXPECT_EQ(got[1].code, LLM_UNLINK_FAILED);
  EXPECT_NE(got[1].why.find("did not answer"), std::string::npos) << got[1].why;
  EXPECT_EQ(got[2].code, LLM_PARAM_INVALID);  // no address to dial
  // Forced, or HIXL: nothing to drop is a success, no address needed.
  for (const auto *rule : {&forced, &hixl}) {
    got = b->UnlinkMany({{kNobody, "127.0.0.1", dead}, {kNobody, "", 0}}, After(2), *rule);
    ASSERT_EQ(got.size(), 2U);
    EXPECT_EQ(got[0].code, LLM_SUCCESS);
    EXPECT_EQ(got[1].code, LLM_SUCCESS);
  }
}

TEST(Session, LinkManyLinksEveryGoodPeerAndReportsTheBadAddress) {
  auto a = Listening(kOwner), a2 = Listening(kOwner2), b = Opened(kReader);
  const uint16_t dead = ddtest::FreePort();
  auto got = b->LinkMany({At(*a, kOwner), {kNobody, "127.0.0.1", dead}, At(*a2, kOwner2)}, After(3), false);
  ASSERT_EQ(got.size(), 3U);
  EXPECT_EQ(got[0].code, LLM_SUCCESS) << got[0].why;
  EXPECT_EQ(got[0].filed, kOwner);
  EXPECT_EQ(got[1].code, LLM_LINK_FAILED);
  EXPECT_FALSE(got[1].why.empty());
  EXPECT_FALSE(b->engine().LastLinkFailure(kNobody).empty());
  EXPECT_EQ(got[2].code, LLM_SUCCESS) << got[2].why;
  EXPECT_TRUE(b->engine().FindLink(kOwner));
  EXPECT_TRUE(b->engine().FindLink(kOwner2));
  EXPECT_FALSE(b->engine().FindLink(kNobody));
  // again: linked already; a peer announcing another id is filed under its own
  got = b->LinkMany({At(*a, kOwner)}, After(3), false);
  EXPECT_EQ(got[0].code, LLM_ALREADY_LINK);
  auto c = Opened(kNobody);
  got = c->LinkMany({At(*a, 1234)}, After(3), true);
  EXPECT_EQ(got[0].code, LLM_SUCCESS) << got[0].why;
  EXPECT_EQ(got[0].filed, kOwner);
  // both ends of both of b's links, at once
  auto un = b->UnlinkMany({At(*a, kOwner), At(*a2, kOwner2)}, After(3), {});
  EXPECT_EQ(un[0].code, LLM_SUCCESS) << un[0].why;
  EXPECT_EQ(un[1].code, LLM_SUCCESS) << un[1].why;
  EXPECT_FALSE(b->engine().HasLinks());
}

TEST(Session, AThreadThatCannotStartFailsItsClusterOnlyAndNeverTerminates) {
  auto a = Listening(kOwner), a2 = Listening(kOwner2), b = Opened(kReader);
  datadist::testing::FailThreadStarts(1);  // the first peer's thread
  auto got = b->LinkMany({At(*a, kOwner), At(*a2, kOwner2)}, After(3), false);
  datadist::testing::FailThreadStarts(0);
  ASSERT_EQ(got.size(), 2U);
  EXPECT_EQ(got[0].code, LLM_LINK_FAILED);
  EXPECT_NE(got[0].why.find("could not start a thread"), std::string::npos) << got[0].why;
  EXPECT_EQ(got[1].code, LLM_SUCCESS) << got[1].why;
  EXPECT_FALSE(b->engine().FindLink(kOwner));
  EXPECT_TRUE(b->engine().FindLink(kOwner2));
  // an unlink whose thread cannot start leaves its link up and says so
  ASSERT_EQ(b->LinkMany({At(*a, kOwner)}, After(3), false)[0].code, LLM_SUCCESS);
  datadist::testing::FailThreadStarts(1);
  auto un = b->UnlinkMany({At(*a, kOwner), At(*a2, kOwner2)}, After(3), {});
  datadist::testing::FailThreadStarts(0);
  EXPECT_EQ(un[0].code, LLM_UNLINK_FAILED);
  EXPECT_TRUE(b->engine().FindLink(kOwner));
  EXPECT_EQ(un[1].code, LLM_SUCCESS) << un[1].why;
  EXPECT_FALSE(b->engine().FindLink(kOwner2));
}

// One owner with a blocks cache filled with known bytes, and a reader linked to it.
struct SessionPair : ::testing::Test {
  void SetUp() override {
    owner = Listening(kOwner);
    reader = Opened(kReader);
    for (uint32_t t = 0; t < 2; ++t)
      for (uint64_t i = 0; i < 8 * 64; ++i) src.cache.T(t)[i] = static_cast<uint8_t>(t * 100 + i / 64 + 1);
    id = owner->engine().registry().Add(src.cache.desc, src.cache.addrs, {});
    auto got = reader->LinkMany({At(*owner, kOwner)}, After(5), false);
    ASSERT_EQ(got[0].code, LLM_SUCCESS) << got[0].why;
  }
  Blocks src{2, 8, 64}, dst{2, 8, 64};
  std::unique_ptr<Session> owner, reader;
  int64_t id = 0;
};

TEST_F(SessionPair, TransferMovesTheBytesAndCountsThemAndItsRefusals) {
  const auto before = Pulls(kOwner, "");
  const datadist::Plan plan = BlockPlan(dst.geo(), {2, 3, 6}, {0, 1, 5});
  EXPECT_EQ(plan.lengths.size(), 2U);  // 2, 3 -> 0, 1 coalesced
  reader->Transfer(false, kOwner, BlockRequest(plan, id, dst.geo().layout), plan, dst.geo(), dst.cache.addrs, After(5));
  for (uint32_t t = 0; t < 2; ++t) {
    EXPECT_EQ(dst.cache.T(t)[0], t * 100 + 3);
    EXPECT_EQ(dst.cache.T(t)[64], t * 100 + 4);
    EXPECT_EQ(dst.cache.T(t)[5 * 64 + 63], t * 100 + 7);
    EXPECT_EQ(dst.cache.T(t)[2 * 64], 0);
  }
  const auto after = Pulls(kOwner, "");
  EXPECT_EQ(after.transfers, before.transfers + 1);
  EXPECT_EQ(after.bytes, before.bytes + 2 * 3 * 64);

  // Over the cap: refused before anything is sent (or a local span made), and counted.
  const auto refused = Pulls(kOwner, "LLM_PARAM_INVALID");
  datadist::Plan huge;
  huge.remote_tensors.assign(4096, 0);
  huge.local_tensors.assign(4096, 0);
  huge.remote_offsets.assign(datadist::kMaxRequestSpans / 4096 + 1, 0);
  huge.local_offsets = huge.remote_offsets;
  huge.lengths.assign(huge.remote_offsets.size(), 1);
  EXPECT_EQ(CodeOf([&] {
              reader->Transfer(false, kOwner, BlockRequest(huge, id, dst.geo().layout), huge, dst.geo(),
                               dst.cache.addrs, After(5));
            }),
            LLM_PARAM_INVALID);
  auto call = datadist::Call::Make(false, kOwner, BlockRequest(huge, id, dst.geo().layout), {});
  EXPECT_EQ(CodeOf([&] { reader->Run(*call, After(5), datadist::Clock::now()); }), LLM_PARAM_INVALID);
  auto task = reader->Submit(call, After(5), datadist::Clock::now());
  ASSERT_TRUE(task->Wait(After(5)));
  EXPECT_EQ(task->code(), LLM_PARAM_INVALID);
  EXPECT_EQ(Pulls(kOwner, "LLM_PARAM_INVALID").errors, refused.errors + 3);

  // No link: LLM_NOT_YET_LINK, counted under the id asked for (our own pulls name it).
  const auto other = Pulls(kNobody, "LLM_NOT_YET_LINK");
  EXPECT_EQ(CodeOf([&] {
              reader->Transfer(false, kNobody, BlockRequest(plan, id, dst.geo().layout), plan, dst.geo(),
                               dst.cache.addrs, After(1));
            }),
            LLM_NOT_YET_LINK);
  EXPECT_EQ(Pulls(kNobody, "LLM_NOT_YET_LINK").errors, other.errors + 1);
}

TEST_F(SessionPair, SubmitEndsWithTheTransfersOutcomeAndFailsOnceClosed) {
  const datadist::Plan plan = BlockPlan(dst.geo(), {7}, {4});
  auto call = datadist::Call::Make(false, kOwner, BlockRequest(plan, id, dst.geo().layout),
                                   datadist::LocalIov(plan, dst.cache.addrs));
  EXPECT_EQ(call->bytes, 2U * 64);
  auto task = reader->Submit(call, After(5), datadist::Clock::now());
  ASSERT_TRUE(task->Wait(After(5)));
  EXPECT_EQ(task->code(), LLM_SUCCESS) << task->message();
  EXPECT_EQ(dst.cache.T(1)[4 * 64], 108);
  auto nowhere = datadist::Call::Make(false, kNobody, call->req, call->iov);
  task = reader->Submit(nowhere, After(5), datadist::Clock::now());
  ASSERT_TRUE(task->Wait(After(5)));
  EXPECT_EQ(task->code(), LLM_NOT_YET_LINK);
  EXPECT_EQ(reader->Close(0.0), 0);
  task = reader->Submit(call, After(5), datadist::Clock::now());
  ASSERT_TRUE(task->Wait(After(1)));
  EXPECT_NE(task->code(), LLM_SUCCESS);
}

// The one check of a transfer's local side (plan.h CheckLocalSpans), both faces': every local
// tensor index and span inside the cache's geometry, overflow-safe, or LLM_PARAM_INVALID
// naming what does not fit.
TEST(Session, CheckLocalSpansRefusesEverySpanOutsideTheLocalCache) {
  datadist::Geometry g;
  g.num_tensors = 2;
  g.tensor_bytes = 512;
  g.units = 8;
  g.unit_bytes = 64;
  auto plan = [](std::vector<uint32_t> tensors, uint64_t off, uint64_t len) {
    datadist::Plan p;
    p.remote_tensors = tensors;
    p.local_tensors = tensors;
    p.remote_offsets = {0};
    p.local_offsets = {off};
    p.lengths = {len};
    return p;
  };
  auto why = [&](const datadist::Plan &p) -> std::string {
    try {
      datadist::CheckLocalSpans(p, g, 7);
      return "";
    } catch (const datadist::Error &e) {
      EXPECT_EQ(e.code(), LLM_PARAM_INVALID);
      return e.what();
    }
  };
  EXPECT_EQ(why(plan({0, 1}, 0, 512)), "");  // a whole tensor
  EXPECT_EQ(why(plan({1}, 448, 64)), "");    // the last block
  EXPECT_NE(why(plan({0, 2}, 0, 64)).find("local tensor 2 is out of range: cache 7 has 2 tensors"), std::string::npos);
  EXPECT_NE(why(plan({0}, 449, 64)).find("local span [449, +64) lies outside the 512 bytes of each tensor of cache 7"),
            std::string::npos);
  EXPECT_NE(why(plan({0}, 0, 513)).find("outside"), std::string::npos);
  // offset + length wraps to a small number: refused all the same
  EXPECT_NE(why(plan({0}, UINT64_MAX - 31, 64)).find("outside"), std::string::npos);
  EXPECT_NE(why(plan({0}, 0, UINT64_MAX)).find("outside"), std::string::npos);
  EXPECT_NE(why(plan({0}, 64, 0)).find("is empty"), std::string::npos);
  datadist::Plan odd = plan({0}, 0, 64);
  odd.local_offsets.push_back(64);
  EXPECT_NE(why(odd).find("differ in length"), std::string::npos);
  odd = plan({0}, 0, 64);
  odd.local_tensors.push_back(1);
  EXPECT_NE(why(odd).find("pairs 2 local tensors with 1"), std::string::npos);
}

// Session::Prepare (the Python binding's only way to make a transfer): the local spans are
// made from the registry's addresses once checked against the cache; Run and Submit hold the
// cache and refuse one that is gone, or filed anew under the id with other memory.
TEST_F(SessionPair, PrepareChecksTheLocalCacheAndItsRunsHoldIt) {
  auto &reg = reader->engine().registry();
  const int64_t mine = reg.Add(dst.cache.desc, dst.cache.addrs, {});
  datadist::wire::Request head;
  head.kind = datadist::wire::kCacheId;
  head.a = static_cast<uint64_t>(id);
  datadist::Plan bad = BlockPlan(dst.geo(), {7}, {4});
  bad.local_offsets[0] = 8 * 64 - 32;  // half past the last block
  const auto refused = Pulls(kOwner, "LLM_PARAM_INVALID");
  try {
    reader->Prepare(false, kOwner, head, bad, mine);
    ADD_FAILURE() << "a span outside the cache was prepared";
  } catch (const datadist::Error &e) {
    EXPECT_EQ(e.code(), LLM_PARAM_INVALID);
    EXPECT_NE(std::string(e.what()).find("lies outside the 512 bytes of each tensor of cache " + std::to_string(mine)),
              std::string::npos)
        << e.what();
  }
  bad = BlockPlan(dst.geo(), {7}, {4});
  bad.local_tensors[1] = 2;
  EXPECT_EQ(CodeOf([&] { reader->Prepare(false, kOwner, head, bad, mine); }), LLM_PARAM_INVALID);
  EXPECT_EQ(CodeOf([&] { reader->Prepare(false, kOwner, head, BlockPlan(dst.geo(), {7}, {4}), 999); }),
            LLM_KV_CACHE_NOT_EXIST);
  EXPECT_EQ(Pulls(kOwner, "LLM_PARAM_INVALID").errors, refused.errors);  // nothing was run

  auto call = reader->Prepare(false, kOwner, head, BlockPlan(dst.geo(), {7}, {4}), mine);
  EXPECT_EQ(call->local_cache, mine);
  EXPECT_EQ(call->req.layout, dst.geo().layout & ~uint64_t{0xFFFFFFFF});  // a contiguous cache's: the dtype
  ASSERT_EQ(call->iov.size(), 2U);
  EXPECT_EQ(reinterpret_cast<uint64_t>(call->iov[1].iov_base), dst.cache.addrs[1] + 4 * 64);
  reader->Run(*call, After(5), datadist::Clock::now());
  EXPECT_EQ(dst.cache.T(1)[4 * 64], 108);
  auto task = reader->Submit(call, After(5), datadist::Clock::now());
  ASSERT_TRUE(task->Wait(After(5)));
  EXPECT_EQ(task->code(), LLM_SUCCESS) << task->message();

  // Gone: the prepared call is refused, run or issued, and counted.
  reg.Remove(mine, false, 1.0);
  const auto gone = Pulls(kOwner, "LLM_KV_CACHE_NOT_EXIST");
  EXPECT_EQ(CodeOf([&] { reader->Run(*call, After(5), datadist::Clock::now()); }), LLM_KV_CACHE_NOT_EXIST);
  EXPECT_EQ(CodeOf([&] { reader->Submit(call, After(5), datadist::Clock::now()); }), LLM_KV_CACHE_NOT_EXIST);
  EXPECT_EQ(Pulls(kOwner, "LLM_KV_CACHE_NOT_EXIST").errors, gone.errors + 2);
  // Filed anew under the same id with other memory: not the cache the spans lie in.
  Blocks other{2, 8, 64};
  reg.Add(mine, other.cache.desc, other.cache.addrs, {});
  try {
    reader->Run(*call, After(5), datadist::Clock::now());
    ADD_FAILURE() << "a call ran into memory it was not prepared for";
  } catch (const datadist::Error &e) {
    EXPECT_EQ(e.code(), LLM_KV_CACHE_NOT_EXIST);
    EXPECT_NE(std::string(e.what()).find("not the cache the transfer was prepared for"), std::string::npos);
  }
  EXPECT_EQ(other.cache.T(1)[4 * 64], 0);
}

// A pull of 100k blocks that coalesce into no run (docs/performance.md, "Large requests"): its
// plan's arrays are each allocated once, at their size (grown by push_back they were allocated
// twice over and kept 131072 slots), and the call PreparePull makes names every block's span,
// local and remote, in order. The C++ face's pulls plan with the same PlanBlocks.
TEST(Session, PreparePullOf100kBlocksSizesEachArrayOnceAndNamesEverySpan) {
  constexpr uint64_t kN = 100000, kBlock = 64;
  Session s(kReader, 1, 1);
  s.engine().Open(datadist::EngineOptions{});
  Blocks dst{2, kN, kBlock};
  const int64_t mine = s.engine().registry().Add(dst.cache.desc, dst.cache.addrs, {});
  datadist::PullSpec spec;
  spec.kind = datadist::PullSpec::kBlocks;
  // remote blocks shuffled (Fisher-Yates, a fixed LCG), local blocks descending: no two
  // neighbours are adjacent on the local side, so every block is a run of its own
  std::vector<uint64_t> from, to;  // the spec's lists are views of these
  for (uint64_t i = 0; i < kN; ++i) {
    from.push_back(i);
    to.push_back(kN - 1 - i);
  }
  uint64_t x = 7;
  for (uint64_t i = kN - 1; i > 0; --i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    std::swap(from[i], from[(x >> 33) % (i + 1)]);
  }
  spec.src_blocks = from;
  spec.dst_blocks = to;
  datadist::Plan plan;
  datadist::PlanBlocks(plan, dst.geo(), spec.src_blocks, spec.dst_blocks);
  ASSERT_EQ(plan.lengths.size(), kN);
  EXPECT_EQ(plan.remote_offsets.capacity(), kN);
  EXPECT_EQ(plan.local_offsets.capacity(), kN);
  EXPECT_EQ(plan.lengths.capacity(), kN);

  datadist::wire::Request head;
  head.kind = datadist::wire::kBlocksKey;
  head.b = 1;
  auto call = s.PreparePull(kOwner, head, spec, mine);
  ASSERT_EQ(call->req.offsets.size(), kN);
  ASSERT_EQ(call->req.lengths.size(), kN);
  ASSERT_EQ(call->iov.size(), 2 * kN);
  EXPECT_EQ(call->iov.capacity(), 2 * kN);
  EXPECT_EQ(call->bytes, 2 * kN * kBlock);
  uint64_t wrong = 0;
  for (uint64_t i = 0; i < kN; ++i) {
    wrong += call->req.offsets[i] != spec.src_blocks[i] * kBlock || call->req.lengths[i] != kBlock;
    for (uint64_t t = 0; t < 2; ++t) {
      const iovec &v = call->iov[t * kN + i];
      wrong +=
          reinterpret_cast<uint64_t>(v.iov_base) != dst.cache.addrs[t] + (kN - 1 - i) * kBlock || v.iov_len != kBlock;
    }
  }
  EXPECT_EQ(wrong, 0U);

  // the same blocks in order: one run, and no array keeps room for 100k
  for (uint64_t i = 0; i < kN; ++i) from[i] = to[i] = i;
  datadist::Plan one;
  datadist::PlanBlocks(one, dst.geo(), spec.src_blocks, spec.dst_blocks);
  EXPECT_EQ(one.lengths.capacity(), 1U);
  call = s.PreparePull(kOwner, head, spec, mine);
  ASSERT_EQ(call->req.lengths.size(), 1U);
  EXPECT_EQ(call->req.lengths[0], kN * kBlock);
  EXPECT_EQ(call->req.offsets.capacity(), 1U);
  ASSERT_EQ(call->iov.size(), 2U);
  EXPECT_EQ(reinterpret_cast<uint64_t>(call->iov[1].iov_base), dst.cache.addrs[1]);
  s.Close(0.0);
}

TEST(Session, CopyLocalCoalescesRunsAndCopiesAnOverlappingRunBlockByBlock) {
  Blocks c{1, 8, 16};
  for (uint64_t i = 0; i < 8 * 16; ++i) c.cache.T(0)[i] = static_cast<uint8_t>(i / 16 + 1);
  // 0, 1, 2 -> 1, 2, 3 in one cache: one span whose bytes overlap, copied in order as three
  // block copies are (CANN's CopyKvBlocks): blocks 1..3 all become block 0.
  datadist::Plan plan = BlockPlan(c.geo(), {0, 1, 2}, {1, 2, 3});
  ASSERT_EQ(plan.lengths.size(), 1U);
  Session::CopyLocal(plan, c.cache.addrs, c.cache.addrs, 16);
  for (uint64_t b = 0; b < 4; ++b) EXPECT_EQ(c.cache.T(0)[b * 16 + 15], 1) << b;
  // 4, 5 -> 6, 7: no overlap, one memmove
  plan = BlockPlan(c.geo(), {4, 5}, {6, 7});
  ASSERT_EQ(plan.lengths.size(), 1U);
  Session::CopyLocal(plan, c.cache.addrs, c.cache.addrs, 16);
  EXPECT_EQ(c.cache.T(0)[6 * 16], 5);
  EXPECT_EQ(c.cache.T(0)[7 * 16 + 15], 6);
  // between two caches, tensor pairs as planned
  Blocks d{1, 8, 16};
  plan = BlockPlan(d.geo(), {6, 7, 0}, {0, 1, 7});
  Session::CopyLocal(plan, c.cache.addrs, d.cache.addrs, 16);
  EXPECT_EQ(d.cache.T(0)[0], 5);
  EXPECT_EQ(d.cache.T(0)[16], 6);
  EXPECT_EQ(d.cache.T(0)[7 * 16], 1);
  EXPECT_EQ(d.cache.T(0)[2 * 16], 0);
}

// CopyCaches: both sides held and every span checked against both before a byte moves.
TEST(Session, CopyCachesRefusesASpanOutsideEitherCacheAndWritesNothing) {
  Session s(9105, 0, 1);
  Blocks a{2, 8, 16}, b{2, 4, 16};
  for (uint64_t i = 0; i < 8 * 16; ++i) a.cache.T(1)[i] = static_cast<uint8_t>(i / 16 + 1);
  const int64_t src = s.engine().registry().Add(a.cache.desc, a.cache.addrs, {});
  const int64_t dst = s.engine().registry().Add(b.cache.desc, b.cache.addrs, {});
  datadist::CopySide from, to;
  from.cache_id = src;
  to.cache_id = dst;
  auto planned = [](std::vector<uint32_t> st, std::vector<uint32_t> dt, std::vector<uint64_t> so,
                    std::vector<uint64_t> dof, std::vector<uint64_t> len) {
    return [=](datadist::Plan &p, const datadist::Geometry &, const datadist::Geometry &) {
      p.remote_tensors = st;
      p.local_tensors = dt;
      p.remote_offsets = so;
      p.local_offsets = dof;
      p.lengths = len;
    };
  };
  // a good first span, then one past the destination's 64 bytes: nothing is copied
  EXPECT_EQ(CodeOf([&] { s.CopyCaches(from, to, planned({1}, {1}, {0, 16}, {0, 56}, {16, 16})); }), LLM_PARAM_INVALID);
  // past the source, a tensor the destination has not, an empty span, offsets that wrap
  EXPECT_EQ(CodeOf([&] { s.CopyCaches(from, to, planned({1}, {1}, {120}, {0}, {16})); }), LLM_PARAM_INVALID);
  EXPECT_EQ(CodeOf([&] { s.CopyCaches(from, to, planned({1}, {2}, {0}, {0}, {16})); }), LLM_PARAM_INVALID);
  EXPECT_EQ(CodeOf([&] { s.CopyCaches(from, to, planned({1}, {1}, {0}, {0}, {0})); }), LLM_PARAM_INVALID);
  EXPECT_EQ(CodeOf([&] { s.CopyCaches(from, to, planned({1}, {1}, {UINT64_MAX - 7}, {0}, {16})); }), LLM_PARAM_INVALID);
  EXPECT_EQ(CodeOf([&] { s.CopyCaches(from, to, planned({0, 1}, {1}, {0}, {0}, {16})); }), LLM_PARAM_INVALID);
  for (uint64_t i = 0; i < 4 * 16; ++i) ASSERT_EQ(b.cache.T(1)[i], 0) << i;
  // a cache not filed: LLM_KV_CACHE_NOT_EXIST, and its hold is let go of the other side
  datadist::CopySide gone;
  gone.cache_id = 999;
  EXPECT_EQ(CodeOf([&] { s.CopyCaches(from, gone, planned({0}, {0}, {0}, {0}, {16})); }), LLM_KV_CACHE_NOT_EXIST);
  EXPECT_EQ(s.engine().registry().Describe(src).leases, 0);
  // the good one copies, and says how many bytes
  EXPECT_EQ(s.CopyCaches(from, to, planned({1}, {1}, {16, 96}, {0, 32}, {32, 16})), 48U);
  EXPECT_EQ(b.cache.T(1)[0], 2);
  EXPECT_EQ(b.cache.T(1)[31], 3);
  EXPECT_EQ(b.cache.T(1)[32], 7);
  EXPECT_EQ(b.cache.T(1)[48], 0);
  EXPECT_EQ(s.engine().registry().Describe(src).leases, 0);
  EXPECT_EQ(s.engine().registry().Describe(dst).leases, 0);
}

TEST(Session, CopyCachesHoldsTheCachesAndCopiesUnfiledMemoryWithinItsDescription) {
  Session s(9106, 0, 1);
  Blocks a{1, 8, 16};
  for (uint64_t i = 0; i < 8 * 16; ++i) a.cache.T(0)[i] = static_cast<uint8_t>(i / 16 + 1);
  const int64_t id = s.engine().registry().Add(a.cache.desc, a.cache.addrs, {});
  std::vector<uint8_t> mine(4 * 16, 0);
  datadist::CopySide filed, unfiled;
  filed.cache_id = id;
  unfiled.geo = {1, 64, 4, 16, 0};
  unfiled.addrs = {reinterpret_cast<uint64_t>(mine.data())};
  // while the planner runs, the filed cache is held: an unregister would wait for it
  int leases_seen = -1;
  s.CopyCaches(filed, unfiled, [&](datadist::Plan &p, const datadist::Geometry &sg, const datadist::Geometry &dg) {
    leases_seen = s.engine().registry().Describe(id).leases;
    EXPECT_EQ(sg.units, 8U);
    EXPECT_EQ(dg.units, 4U);
    p = BlockPlan(dg, {3, 4}, {0, 1});
  });
  EXPECT_EQ(leases_seen, 1);
  EXPECT_EQ(mine[0], 4);
  EXPECT_EQ(mine[31], 5);
  EXPECT_EQ(mine[32], 0);
  // an unfiled side whose description is bad is refused before anything
  datadist::CopySide bad = unfiled;
  bad.addrs = {0};
  EXPECT_EQ(CodeOf([&] { s.CopyCaches(filed, bad, [](datadist::Plan &, auto &, auto &) {}); }), LLM_PARAM_INVALID);
  bad.addrs = {UINT64_MAX - 8};
  EXPECT_EQ(CodeOf([&] { s.CopyCaches(filed, bad, [](datadist::Plan &, auto &, auto &) {}); }), LLM_PARAM_INVALID);
  bad = unfiled;
  bad.geo.units = 3;
  bad.geo.unit_bytes = 21;
  EXPECT_EQ(CodeOf([&] { s.CopyCaches(filed, bad, [](datadist::Plan &, auto &, auto &) {}); }), LLM_PARAM_INVALID);
  // within one cache, a run shifted by a block copies block by block in order (CopyLocal)
  s.CopyCaches(filed, filed, [](datadist::Plan &p, const datadist::Geometry &sg, const datadist::Geometry &) {
    p = BlockPlan(sg, {0, 1, 2}, {1, 2, 3});
  });
  for (uint64_t blk = 0; blk < 4; ++blk) EXPECT_EQ(a.cache.T(0)[blk * 16 + 15], 1) << blk;
  EXPECT_EQ(a.cache.T(0)[4 * 16], 5);
}

}  // namespace

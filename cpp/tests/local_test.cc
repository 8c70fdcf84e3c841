// The same-host path (docs/protocol.md, "The local channel", "Pull on the same host"): the
// owner serves its local channel and grants only there, within its limits; a client on the
// same host links over it and reads with process_vm_readv. In one process (the kernel lets a
// process read itself); the cross-process cases, a refusing kernel included, are in
// tests/interop/test_local.py.
#include "local.h"

#include <gtest/gtest.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "errors.h"
#include "lease.h"
#include "link.h"
#include "server.h"
#include "test_util.h"
#include "wire.h"

namespace {

using namespace llm_datadist;
namespace w = datadist::wire;
using datadist::After;
using ddtest::HostCache;

constexpr uint64_t kOwner = 9, kClient = 10;

using ddtest::Seconds;

w::Hello ClientHello() {
  w::Hello h;
  h.cluster_id = kClient;
  h.pid = static_cast<uint32_t>(getpid());
  h.pid_ns = datadist::local::HostIdentity::Current().pid_ns;
  h.boot_id = datadist::local::HostIdentity::Current().boot_id;
  return h;
}

/// An owner (registry + server) with one registered cache of 4 tensors x 4 slots x 64 bytes.
class Owner : public ::testing::Test {
 protected:
  void SetUp() override {
    ident.cluster_id = kOwner;
    src.Fill(3);
    cache_id = registry.Add(src.desc, src.addrs, {});
    server = std::make_unique<datadist::Server>(&registry, &ident);
    server->Start("127.0.0.1", 0, 256, 8);
    ASSERT_TRUE(server->serves_local());
  }
  void TearDown() override { server->Stop(); }
  /// A request for `tensors` of slot `slot`, one span.
  static w::Request Slot(std::vector<uint32_t> tensors, uint64_t slot, uint64_t offset, uint64_t length) {
    w::Request q;
    q.kind = w::kCacheId;
    q.a = 1;
    q.b = slot;
    q.tensors = std::move(tensors);
    q.offsets = {offset};
    q.lengths = {length};
    return q;
  }
  /// A raw connection to the owner's local channel, greeted.
  std::unique_ptr<datadist::Conn> Local() {
    auto c = datadist::local::Connect(datadist::local::Name(getpid(), kOwner), After(2));
    c->SendFrame(w::EncodeHello(w::kHello, ClientHello(), 1), After(2));
    std::vector<uint8_t> p;
    w::Header h = c->RecvFrame(p, After(2));
    EXPECT_EQ(h.type, w::kWelcome);
    EXPECT_TRUE(w::DecodeHello(p).features & w::kFeatureLocal);
    return c;
  }
  /// Sends `frame`, returns the answer (type, payload).
  static std::pair<w::Header, std::vector<uint8_t>> Ask(datadist::Conn &c, const std::vector<uint8_t> &frame) {
    c.SendFrame(frame, After(2));
    std::vector<uint8_t> p;
    w::Header h = c.RecvFrame(p, After(2));
    return {h, p};
  }
  HostCache src{4, {4, 64}};
  datadist::Registry registry;
  datadist::Identity ident;
  std::unique_ptr<datadist::Server> server;
  int64_t cache_id = 0;
};

TEST_F(Owner, SameHostClientLinksOverTheLocalChannelAndReadsWithCma) {
  datadist::Link link(kOwner, "127.0.0.1", server->port(), ClientHello(), "", nullptr, true, 0);
  link.Open(After(3));
  ASSERT_EQ(link.path(), datadist::Link::Path::kCma);
  // slot 2 of tensors 3 and 1, bytes 8..40, into two local buffers
  uint8_t a[32] = {}, b[32] = {};
  link.Read(Slot({3, 1}, 2, 8, 32), {{a, 32}, {b, 32}}, After(2));
  EXPECT_EQ(std::memcmp(a, src.T(3) + 2 * 64 + 8, 32), 0);
  EXPECT_EQ(std::memcmp(b, src.T(1) + 2 * 64 + 8, 32), 0);
  // the owner's checks stay the owner's: a span past the tensor is refused, nothing moves
  uint8_t c[64] = {};
  try {
    link.Read(Slot({0}, 3, 32, 64), {{c, 64}}, After(2));
    FAIL() << "a span past the tensor was served";
  } catch (const datadist::Error &e) {
    EXPECT_EQ(e.code(), LLM_PARAM_INVALID) << e.what();
  }
  for (uint8_t x : c) ASSERT_EQ(x, 0);
  try {
    w::Request unknown = Slot({0}, 0, 0, 8);
    unknown.a = 42;
    link.Read(unknown, {{c, 8}}, After(2));
    FAIL() << "an unknown cache was served";
  } catch (const datadist::Error &e) {
    EXPECT_EQ(e.code(), LLM_KV_CACHE_NOT_EXIST);
  }
  // and the link still reads (every grant was released: the cache can go at once)
  link.Read(Slot({0}, 1, 0, 64), {{c, 64}}, After(2));
  EXPECT_EQ(std::memcmp(c, src.T(0) + 64, 64), 0);
  auto t0 = std::chrono::steady_clock::now();
  registry.Remove(cache_id, false, 5.0);
  EXPECT_LT(Seconds(t0), 1.0);
  link.Close(After(1), true);
}

// Issue 22 item 8: the same-host decision goes by the peer's boot id, not its address, so a
// peer reached at the IPv6 loopback is on this host too, and a TCP-forced link stays TCP.
TEST(Ipv6, AnOwnerAtTheIpv6LoopbackIsOnThisHost) {
  if (ddtest::FreePort6() == 0) GTEST_SKIP() << "no IPv6 loopback on this host";
  HostCache src{4, {4, 64}};
  src.Fill(3);
  datadist::Registry registry;
  datadist::Identity ident;
  ident.cluster_id = kOwner;
  const int64_t id = registry.Add(src.desc, src.addrs, {});
  datadist::Server server(&registry, &ident);
  server.Start("::1", 0, 256, 8);
  ASSERT_GT(server.port(), 0);
  datadist::Link link(kOwner, "::1", server.port(), ClientHello(), "", nullptr, true, 0);
  link.Open(After(3));
  EXPECT_EQ(link.path(), datadist::Link::Path::kCma);
  datadist::Link tcp(kOwner, "::1", server.port(), ClientHello(), "", nullptr, /*same_host=*/false);
  tcp.Open(After(3));
  EXPECT_EQ(tcp.path(), datadist::Link::Path::kTcp);
  for (datadist::Link *l : {&link, &tcp}) {
    uint8_t a[64] = {};
    w::Request q;  // slot 1 of tensor 2
    q.kind = w::kCacheId;
    q.a = static_cast<uint64_t>(id);
    q.b = 1;
    q.tensors = {2};
    q.offsets = {0};
    q.lengths = {64};
    l->Read(q, {{a, 64}}, After(2));
    EXPECT_EQ(std::memcmp(a, src.T(2) + 64, 64), 0);
    l->Close(After(1), true);
  }
  server.Stop();
}

TEST_F(Owner, CacheLeasesAreLocalFencedRevokedAndDrained) {
  w::LeaseRequest q;
  q.kind = w::kCacheId;
  q.a = static_cast<uint64_t>(cache_id);
  // over TCP no lease (no address is disclosed); the connection stays usable
  {
    auto tcp = datadist::Conn::Connect("127.0.0.1", server->port(), After(2));
    ASSERT_EQ(Ask(*tcp, w::EncodeHello(w::kHello, ClientHello(), 1)).first.type, w::kWelcome);
    auto [h, p] = Ask(*tcp, w::EncodeLeaseRequest(q, 2));
    ASSERT_EQ(h.type, w::kError);
    EXPECT_EQ(w::DecodeError(p).code, static_cast<int64_t>(LLM_PARAM_INVALID));
    EXPECT_EQ(Ask(*tcp, w::EncodeU64(w::kPing, 5, 3)).first.type, w::kPong);
  }
  auto c = Local();
  auto [h, p] = Ask(*c, w::EncodeLeaseRequest(q, 2));
  ASSERT_EQ(h.type, w::kCacheLease);
  w::CacheLease l = w::DecodeCacheLease(p);
  EXPECT_EQ(l.cache_id, static_cast<uint64_t>(cache_id));
  EXPECT_EQ(l.tensor_bytes, 256U);
  EXPECT_EQ(l.units, 4U);
  EXPECT_EQ(l.addrs, src.addrs);
  EXPECT_TRUE(l.shm_fds.empty());
  std::string why;
  auto fence = datadist::lease::FenceView::Open(getpid(), l.fence_fd, l.fence_ino, why);
  ASSERT_TRUE(fence) << why;
  EXPECT_FALSE(datadist::lease::FenceView::Open(getpid(), l.fence_fd, l.fence_ino + 1, why)) << "inode not checked";
  // a second lease on the live cache: the same fence
  auto again = w::DecodeCacheLease(Ask(*c, w::EncodeLeaseRequest(q, 3)).second);
  EXPECT_EQ(again.fence_ino, l.fence_ino);
  // a copy in flight (our shared lock) holds the unregister back until it ends
  ASSERT_TRUE(fence->Enter());
  auto t0 = std::chrono::steady_clock::now();
  std::thread remover([&] { registry.Remove(cache_id, false, 5.0); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_TRUE(fence->Revoked());
  EXPECT_FALSE(fence->Enter());  // revoked: no copy starts, even beside one in flight
  fence->Leave();
  remover.join();
  const double took = Seconds(t0);
  EXPECT_GE(took, 0.1);
  EXPECT_LT(took, 2.0);
  EXPECT_FALSE(fence->Enter());
  auto [gh, gp] = Ask(*c, w::EncodeLeaseRequest(q, 4));
  ASSERT_EQ(gh.type, w::kError);
  EXPECT_EQ(w::DecodeError(gp).code, static_cast<int64_t>(LLM_KV_CACHE_NOT_EXIST));
}

TEST_F(Owner, AnUnregisterThatTimesOutLeavesTheCacheWithANewFence) {
  datadist::Link link(kOwner, "127.0.0.1", server->port(), ClientHello(), "", nullptr, true);
  link.Open(After(3));
  ASSERT_EQ(link.path(), datadist::Link::Path::kCma);
  uint8_t a[64] = {};
  link.Read(Slot({2}, 1, 0, 64), {{a, 64}}, After(2));  // leased
  EXPECT_EQ(std::memcmp(a, src.T(2) + 64, 64), 0);
  // another reader's copy in flight outlasts the unregister's wait
  auto c = Local();
  w::LeaseRequest q;
  q.kind = w::kBlocksKey;  // a C++ owner resolves a model id as its cache id
  q.b = static_cast<uint64_t>(cache_id);
  auto first = w::DecodeCacheLease(Ask(*c, w::EncodeLeaseRequest(q, 2)).second);
  std::string why;
  auto fence = datadist::lease::FenceView::Open(getpid(), first.fence_fd, first.fence_ino, why);
  ASSERT_TRUE(fence && fence->Enter()) << why;
  try {
    registry.Remove(cache_id, false, 0.2);
    FAIL() << "removed under a copy in flight";
  } catch (const datadist::Error &e) {
    EXPECT_EQ(e.code(), LLM_TIMEOUT);
  }
  fence->Leave();
  // still registered; the link's lease was revoked: it asks the owner, then leases anew
  for (int i = 0; i < 2; ++i) {
    std::memset(a, 0, sizeof(a));
    link.Read(Slot({3}, 2, 0, 64), {{a, 64}}, After(2));
    EXPECT_EQ(std::memcmp(a, src.T(3) + 128, 64), 0);
  }
  auto second = w::DecodeCacheLease(Ask(*c, w::EncodeLeaseRequest(q, 3)).second);
  EXPECT_NE(second.fence_ino, first.fence_ino);
  // the reader's checks are the owner's
  try {
    link.Read(Slot({4}, 0, 0, 8), {{a, 8}}, After(2));
    FAIL() << "tensor 4 of 4 was read";
  } catch (const datadist::Error &e) {
    EXPECT_EQ(e.code(), LLM_PARAM_INVALID);
  }
  registry.Remove(cache_id, false, 2.0);
  try {
    link.Read(Slot({3}, 2, 0, 64), {{a, 64}}, After(2));
    FAIL() << "an unregistered cache was read";
  } catch (const datadist::Error &e) {
    EXPECT_EQ(e.code(), LLM_KV_CACHE_NOT_EXIST);
  }
  link.Close(After(1), false);
}

TEST(Fence, SharedLocksAreCountedPerDescriptionAndDrainWaitsForAll) {
  datadist::lease::Fence owner;
  std::string why;
  auto view = datadist::lease::FenceView::Open(getpid(), owner.fd(), owner.ino(), why);
  ASSERT_TRUE(view) << why;
  ASSERT_TRUE(view->Enter());
  ASSERT_TRUE(view->Enter());  // a second thread's copy: the same open file description
  owner.Revoke();
  EXPECT_FALSE(owner.Drained());
  view->Leave();
  EXPECT_FALSE(owner.Drained()) << "the first Leave dropped the lock another copy holds";
  view->Leave();
  EXPECT_TRUE(owner.Drained());
  EXPECT_FALSE(view->Enter());
}

/// A lease on `mem` (one tensor of `bytes`, one slot) held by this process on itself, under
/// `fence`, for the unlocked-read tests below.
std::shared_ptr<datadist::lease::Leased> SelfLease(datadist::lease::Fence &fence, const uint8_t *mem, uint64_t bytes,
                                                   bool write) {
  w::CacheLease msg;
  msg.cache_id = 1;
  msg.tensor_bytes = bytes;
  msg.units = 1;
  msg.fence_fd = fence.fd();
  msg.fence_ino = fence.ino();
  msg.addrs = {reinterpret_cast<uint64_t>(mem)};
  std::string why;
  auto owner = datadist::lease::OwnerProc::Open(getpid(), why);
  EXPECT_TRUE(owner) << why;
  auto l = datadist::lease::Make(std::move(msg), 1, write, owner, why);
  EXPECT_TRUE(l) << why;
  return l;
}

w::Request WholeSlot(uint64_t bytes) {
  w::Request q;
  q.kind = w::kCacheId;
  q.a = 1;
  q.tensors = {0};
  q.offsets = {0};
  q.lengths = {bytes};
  return q;
}

// A leased read by process_vm_readv takes no lock on the fence (two system calls less a read):
// an exclusive lock on the owner's side, with the byte still 0, does not stop it; a write (and
// the owner's drain of writes) still goes by the lock.
TEST(Fence, AReadByCrossMemoryAttachTakesNoLockAWriteDoes) {
  datadist::lease::Fence fence;
  std::vector<uint8_t> mem(4096, 7), got(4096, 0);
  auto reader = SelfLease(fence, mem.data(), mem.size(), false);
  auto writer = SelfLease(fence, mem.data(), mem.size(), true);
  ASSERT_TRUE(reader && writer);
  ASSERT_EQ(flock(fence.fd(), LOCK_EX | LOCK_NB), 0);
  std::string why;
  EXPECT_EQ(datadist::lease::Copy(*reader, WholeSlot(mem.size()), {{got.data(), got.size()}}, why),
            datadist::lease::Outcome::kDone)
      << why;
  EXPECT_EQ(got, mem);
  std::vector<uint8_t> data(4096, 9);
  EXPECT_EQ(datadist::lease::Copy(*writer, WholeSlot(mem.size()), {{data.data(), data.size()}}, why),
            datadist::lease::Outcome::kRevoked);
  EXPECT_EQ(mem[0], 7) << "a write went by a fence being drained";
  flock(fence.fd(), LOCK_UN);
  fence.Revoke();
  EXPECT_EQ(datadist::lease::Copy(*reader, WholeSlot(mem.size()), {{got.data(), got.size()}}, why),
            datadist::lease::Outcome::kRevoked);
}

// The unlocked read's safety: the owner revokes, drains (which no longer waits for it), and
// gives the memory its next life (here: rewrites it) while reads run. A read whose copy saw
// any of the new bytes must not be reported done: every read done holds the old bytes only.
// (Without the check after the copy, reads of mixed bytes are reported done.)
TEST(Fence, AnUnlockedReadThatOverlapsARevokeIsNeverDone) {
  constexpr uint64_t kBytes = 8 << 20;
  std::vector<uint8_t> mem(kBytes), got(kBytes);
  int mixed = 0, done = 0, revoked_mid = 0;
  for (int trial = 0; trial < 12; ++trial) {
    datadist::lease::Fence fence;
    std::memset(mem.data(), 'A', kBytes);
    auto l = SelfLease(fence, mem.data(), kBytes, false);
    ASSERT_TRUE(l);
    std::atomic<bool> stop{false};
    std::thread reader([&] {
      while (!stop.load()) {
        std::string why;
        got[0] = got[kBytes - 1] = 0;
        const auto out = datadist::lease::Copy(*l, WholeSlot(kBytes), {{got.data(), kBytes}}, why);
        if (out == datadist::lease::Outcome::kDone) {
          ++done;
          if (std::memchr(got.data(), 'B', kBytes) != nullptr) ++mixed;
        } else if (out == datadist::lease::Outcome::kRevoked && !why.empty()) {
          ++revoked_mid;
        }
      }
    });
    std::this_thread::sleep_for(std::chrono::microseconds(1500 + 700 * trial));
    fence.Revoke();
    while (!fence.Drained()) std::this_thread::yield();
    std::memset(mem.data(), 'B', kBytes);  // the memory's next life
    stop = true;
    reader.join();
  }
  EXPECT_GT(done, 0);
  EXPECT_EQ(mixed, 0) << "reads of the memory's next life were reported done (" << revoked_mid
                      << " caught after the copy)";
}

TEST_F(Owner, ForcedTcpAndPushesStreamOverTheControlChannel) {
  datadist::Link tcp(kOwner, "127.0.0.1", server->port(), ClientHello(), "", nullptr, /*same_host=*/false);
  tcp.Open(After(3));
  EXPECT_EQ(tcp.path(), datadist::Link::Path::kTcp);
  uint8_t a[64] = {};
  tcp.Read(Slot({2}, 3, 0, 64), {{a, 64}}, After(2));
  EXPECT_EQ(std::memcmp(a, src.T(2) + 3 * 64, 64), 0);
  // a push over a local link lands in the owner's memory (under a write lease)
  datadist::Link local(kOwner, "127.0.0.1", server->port(), ClientHello(), "", nullptr, true, 0);
  local.Open(After(3));
  ASSERT_EQ(local.path(), datadist::Link::Path::kCma);
  uint8_t data[16];
  for (int i = 0; i < 16; ++i) data[i] = static_cast<uint8_t>(200 + i);
  local.Write(Slot({1}, 0, 4, 16), {{data, 16}}, After(2));
  EXPECT_EQ(std::memcmp(src.T(1) + 4, data, 16), 0);
  tcp.Close(After(1), false);
  local.Close(After(1), false);
}

TEST_F(Owner, GrantsOnlyOnTheLocalChannelAndWithinLimits) {
  // over TCP a GRANT is refused and no address is disclosed; the connection stays usable
  {
    auto tcp = datadist::Conn::Connect("127.0.0.1", server->port(), After(2));
    auto [wh, wp] = Ask(*tcp, w::EncodeHello(w::kHello, ClientHello(), 1));
    ASSERT_EQ(wh.type, w::kWelcome);
    w::Request q = Slot({0}, 0, 0, 64);
    q.flags = w::kFlagGrant;
    auto [h, p] = Ask(*tcp, w::EncodeRequest(w::kRead, q, 2));
    ASSERT_EQ(h.type, w::kError);
    EXPECT_EQ(w::DecodeError(p).code, static_cast<int64_t>(LLM_PARAM_INVALID));
    q.flags = 0;
    EXPECT_EQ(Ask(*tcp, w::EncodeRequest(w::kRead, q, 3)).first.type, w::kReadData);
  }
  auto c = Local();
  w::Request q = Slot({1, 3}, 2, 0, 16);
  q.flags = w::kFlagGrant | w::kFlagChecksum;
  auto [h, p] = Ask(*c, w::EncodeRequest(w::kRead, q, 2));
  ASSERT_EQ(h.type, w::kGrant);
  w::Grant g = w::DecodeGrant(p);
  // the slot bases of the tensors asked for, in the owner's address space
  EXPECT_EQ(g.bases, (std::vector<uint64_t>{src.addrs[1] + 128, src.addrs[3] + 128}));
  std::vector<uint8_t> ck;
  ASSERT_EQ(c->RecvFrame(ck, After(2)).type, w::kChecksum);  // CRC of the granted spans
  uint32_t crc = w::Crc32(0, src.T(1) + 128, 16);
  crc = w::Crc32(crc, src.T(3) + 128, 16);
  EXPECT_EQ(ck[0] | ck[1] << 8 | ck[2] << 16 | static_cast<uint32_t>(ck[3]) << 24, crc);
  // an out-of-bounds grant: refused, no address given
  w::Request bad = Slot({0}, 3, 1, 64);
  bad.flags = w::kFlagGrant;
  auto [bh, bp] = Ask(*c, w::EncodeRequest(w::kRead, bad, 3));
  ASSERT_EQ(bh.type, w::kError);
  EXPECT_EQ(w::DecodeError(bp).code, static_cast<int64_t>(LLM_PARAM_INVALID));
  // four unreleased grants per connection, then LLM_LINK_BUSY; a RELEASE makes room
  q.flags = w::kFlagGrant;
  std::vector<uint64_t> held{g.lease_id};
  for (uint32_t rid = 4; rid < 7; ++rid) {
    auto [gh, gp] = Ask(*c, w::EncodeRequest(w::kRead, q, rid));
    ASSERT_EQ(gh.type, w::kGrant);
    held.push_back(w::DecodeGrant(gp).lease_id);
  }
  auto [fh, fp] = Ask(*c, w::EncodeRequest(w::kRead, q, 7));
  ASSERT_EQ(fh.type, w::kError);
  EXPECT_EQ(w::DecodeError(fp).code, static_cast<int64_t>(LLM_LINK_BUSY));
  c->SendFrame(w::EncodeRelease({held.back(), true}, 0), After(2));
  held.pop_back();
  ASSERT_EQ(Ask(*c, w::EncodeRequest(w::kRead, q, 8)).first.type, w::kGrant);
  // sixteen per peer process over all its connections
  std::vector<std::unique_ptr<datadist::Conn>> more;
  uint32_t granted = 0, busy = 0;
  for (int i = 0; i < 4; ++i) {
    more.push_back(Local());
    for (uint32_t rid = 2; rid < 6; ++rid) {
      auto [mh, mp] = Ask(*more.back(), w::EncodeRequest(w::kRead, q, rid));
      if (mh.type == w::kGrant) ++granted;
      if (mh.type == w::kError && w::DecodeError(mp).code == static_cast<int64_t>(LLM_LINK_BUSY)) ++busy;
    }
  }
  EXPECT_EQ(granted, 12U);  // 4 held on the first connection + 12 = 16
  EXPECT_EQ(busy, 4U);
  // the connections closing release their grants: the cache can be unregistered at once
  more.clear();
  c.reset();
  auto t0 = std::chrono::steady_clock::now();
  registry.Remove(cache_id, false, 5.0);
  EXPECT_LT(Seconds(t0), 1.0);
}

TEST_F(Owner, AnUnreleasedGrantExpiresOnceTheMemoryIsWantedBack) {
  auto c = Local();
  w::Request q = Slot({0}, 0, 0, 64);
  q.flags = w::kFlagGrant;
  ASSERT_EQ(Ask(*c, w::EncodeRequest(w::kRead, q, 2)).first.type, w::kGrant);
  // the reader never releases: unregistering waits for the 5 s reclaim grace, not 30 s
  auto t0 = std::chrono::steady_clock::now();
  registry.Remove(cache_id, false, 20.0);
  EXPECT_GE(Seconds(t0), 4.5);
  EXPECT_LT(Seconds(t0), 8.0);
  // a late RELEASE settles nothing and the connection is still served
  c->SendFrame(w::EncodeRelease({1, true}, 0), After(2));
  EXPECT_EQ(Ask(*c, w::EncodeU64(w::kPing, 7, 3)).first.type, w::kPong);
}

TEST_F(Owner, LocalConnectionsAreCappedPerUidWithAnErrorAnswer) {
  // the fixture's server allows 8 connections per peer; local peers count by uid (issue 21
  // item 3: a per-pid count let a fork multiply it)
  std::vector<std::unique_ptr<datadist::Conn>> conns;
  for (int i = 0; i < 8; ++i) conns.push_back(Local());
  auto over = datadist::local::Connect(datadist::local::Name(getpid(), kOwner), After(2));
  auto [h, p] = Ask(*over, w::EncodeHello(w::kHello, ClientHello(), 1));
  ASSERT_EQ(h.type, w::kError);
  EXPECT_EQ(w::DecodeError(p).code, static_cast<int64_t>(LLM_LINK_FAILED));
  EXPECT_NE(w::DecodeError(p).message.find("uid " + std::to_string(getuid())), std::string::npos);
  EXPECT_GE(server->refused(), 1U);
}

TEST_F(Owner, PtracePermissionIsTakenAtTheFirstGrantAndGivenBackOnStop) {
  const size_t before = datadist::local::Ptracer::Users();
  datadist::Link link(kOwner, "127.0.0.1", server->port(), ClientHello(), "", nullptr, true, 0);
  link.Open(After(3));
  EXPECT_EQ(datadist::local::Ptracer::Users(), before);  // linking grants nothing
  uint8_t a[8];
  link.Read(Slot({0}, 0, 0, 8), {{a, 8}}, After(2));
  EXPECT_EQ(datadist::local::Ptracer::Users(), before + 1);
  link.Close(After(1), true);
  server->Stop();
  EXPECT_EQ(datadist::local::Ptracer::Users(), before);
  EXPECT_FALSE(datadist::local::Ptracer::State().empty());
}

TEST(LocalChannel, NameAndIdentityAreThePythonOnes) {
  std::string name = datadist::local::Name(1234, 7);
  EXPECT_EQ(name, std::string("\0datadist-v1.1234.7", 19));
  auto &me = datadist::local::HostIdentity::Current();
  EXPECT_TRUE(me.ClaimsSameHost(me.boot_id));
  EXPECT_FALSE(me.ClaimsSameHost({}));
  // a name taken (by another instance of ours with the same cluster id): TCP only
  int a = datadist::local::Listen(datadist::local::Name(getpid(), 77));
  ASSERT_GE(a, 0);
  EXPECT_EQ(datadist::local::Listen(datadist::local::Name(getpid(), 77)), -1);
  close(a);
  // nobody serves a name: LLM_LINK_FAILED at once
  try {
    datadist::local::Connect(datadist::local::Name(getpid(), 78), After(1));
    FAIL();
  } catch (const datadist::Error &e) {
    EXPECT_EQ(e.code(), LLM_LINK_FAILED);
  }
}

TEST(LocalChannel, VmReadCopiesAndFailsOnBadSpans) {
  std::vector<uint8_t> src(3000), dst(3000, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7);
  // 1500 spans of 2 bytes: more than one IOV_MAX batch
  std::vector<iovec> l, r;
  for (size_t i = 0; i < 1500; ++i) {
    l.push_back({dst.data() + 2 * i, 2});
    r.push_back({src.data() + 2 * (1499 - i), 2});
  }
  std::string why;
  ASSERT_EQ(datadist::local::VmRead(getpid(), l, r, why), datadist::local::CopyResult::kDone);
  for (size_t i = 0; i < 1500; ++i) ASSERT_EQ(std::memcmp(&dst[2 * i], &src[2 * (1499 - i)], 2), 0);
  // an unmapped source: LLM_LINK_FAILED, never a crash
  std::vector<iovec> bad{{reinterpret_cast<void *>(8), 8}};
  try {
    datadist::local::VmRead(getpid(), {{dst.data(), 8}}, bad, why);
    FAIL();
  } catch (const datadist::Error &e) {
    EXPECT_EQ(e.code(), LLM_LINK_FAILED);
  }
}

TEST(LocalFacade, TransportOptionAndSameHostTransfers) {
  uint16_t port = ddtest::FreePort();
  HostCache src(4, {8, 32}), dst(4, {8, 32});
  LlmDataDist prompt(kOwner, LlmRole::kPrompt), decoder(kClient, LlmRole::kDecoder);
  ASSERT_EQ(prompt.Initialize(ddtest::Options(port)), LLM_SUCCESS);
  auto o = ddtest::Options();
  o["datadist.Transport"] = "carrier-pigeon";
  EXPECT_EQ(decoder.Initialize(o), LLM_PARAM_INVALID);
  o["datadist.Transport"] = "tcp";
  ASSERT_EQ(decoder.Initialize(o), LLM_SUCCESS);
  ASSERT_EQ(src.Register(prompt), LLM_SUCCESS);
  ASSERT_EQ(dst.Register(decoder), LLM_SUCCESS);
  src.Fill(11);
  std::vector<Status> rets;
  ASSERT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(kOwner, port)}, rets, 3000), LLM_SUCCESS);
  ASSERT_EQ(decoder.PullKvBlocks(ddtest::Index(kOwner, 1), dst.cache, {7, 1}, {0, 5}), LLM_SUCCESS);
  for (int t = 0; t < 4; ++t) {
    EXPECT_EQ(std::memcmp(dst.T(t), src.T(t) + 7 * 32, 32), 0);
    EXPECT_EQ(std::memcmp(dst.T(t) + 5 * 32, src.T(t) + 32, 32), 0);
  }
  decoder.Finalize();
  // and the same over the local channel (the default)
  ASSERT_EQ(decoder.Initialize(ddtest::Options()), LLM_SUCCESS);
  HostCache dst2(4, {8, 32});
  ASSERT_EQ(dst2.Register(decoder), LLM_SUCCESS);
  ASSERT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(kOwner, port)}, rets, 3000), LLM_SUCCESS);
  ASSERT_EQ(decoder.PullKvCache(ddtest::Index(kOwner, 1, 6), dst2.cache, 2), LLM_SUCCESS);
  ASSERT_EQ(decoder.PullKvBlocks(ddtest::Index(kOwner, 1), dst2.cache, {3, 4}, {0, 1}, ddtest::Ext({1, 1}, {1, 1})),
            LLM_SUCCESS);
  for (int t = 0; t < 4; ++t) {
    EXPECT_EQ(std::memcmp(dst2.T(t) + 2 * 32, src.T(t) + 6 * 32, 32), 0);
    EXPECT_EQ(std::memcmp(dst2.T(t), t >= 2 ? src.T(t) + 3 * 32 : std::vector<uint8_t>(64).data(), 64), 0) << t;
  }
  ASSERT_EQ(decoder.PushKvBlocks(dst2.cache, ddtest::Index(kOwner, 1), {2}, {0}), LLM_SUCCESS);
  for (int t = 0; t < 4; ++t) EXPECT_EQ(std::memcmp(src.T(t), dst2.T(t) + 2 * 32, 32), 0);
  decoder.Finalize();
  prompt.Finalize();
}

}  // namespace

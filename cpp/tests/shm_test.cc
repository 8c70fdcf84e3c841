// Shared memory on one host (shm.h): what a reader maps and refuses to map, SHM grants and
// leases served for caches in sealed memfds, and pulls that copy from the owner's mapping.
// The rules are Python's (tests/security/test_same_host_trust.py is the spec); the owner and
// the reader are one process here (a process may open its own /proc/self/fd), the
// cross-process pairs are in tests/e2e (test_shm_engines.py).
#include "shm.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>

#include "errors.h"
#include "lease.h"
#include "link.h"
#include "local.h"
#include "server.h"
#include "test_util.h"
#include "wire.h"

namespace {

using namespace llm_datadist;
namespace w = datadist::wire;
namespace shm = datadist::shm;
using datadist::After;

constexpr uint64_t kOwner = 19, kClient = 20;
constexpr uint64_t kSize = 1 << 16;

uint64_t Ino(int fd) {
  struct stat st {};
  fstat(fd, &st);
  return st.st_ino;
}

/// A memfd of `size` bytes, sealed against shrinking unless `sealed` is false.
int Memfd(uint64_t size, bool sealed = true) {
  const int fd = static_cast<int>(syscall(SYS_memfd_create, "shm-test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  EXPECT_GE(fd, 0);
  EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
  if (sealed) {
    EXPECT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  }
  return fd;
}

void ExpectViolation(const std::function<void()> &f, const std::string &says) {
  try {
    f();
    FAIL() << "not refused: " << says;
  } catch (const datadist::Error &e) {
    EXPECT_EQ(e.code(), datadist::kSuspectRemoteError) << e.what();
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
  }
}

TEST(ShmMap, OnlyASealedRegularFileWithTheNamedInodeIsMapped) {
  auto region = shm::Region::Create("shm-test", kSize);
  std::memset(region->addr(), 7, kSize);
  std::string why;
  shm::MappingPtr m = shm::Map(getpid(), region->fd(), region->ino(), why);
  ASSERT_TRUE(m) << why;
  EXPECT_EQ(m->size(), kSize);
  EXPECT_EQ(m->addr()[kSize - 1], 7);
  // another inode than the one named: a lying owner
  ExpectViolation([&] { shm::Map(getpid(), region->fd(), region->ino() + 1, why); }, "not the memory the owner named");
  // a file the owner could shrink under our copy (SIGBUS): not mapped, cross-memory attach instead
  const int loose = Memfd(kSize, false);
  why.clear();
  EXPECT_FALSE(shm::Map(getpid(), loose, Ino(loose), why));
  EXPECT_NE(why.find("not sealed against shrinking"), std::string::npos) << why;
  close(loose);
  // an empty file
  const int empty = Memfd(0);
  ExpectViolation([&] { shm::Map(getpid(), empty, Ino(empty), why); }, "is empty");
  close(empty);
  // a FIFO is refused at once (opened non-blocking), not waited on
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  const auto t0 = std::chrono::steady_clock::now();
  ExpectViolation([&] { shm::Map(getpid(), pipefd[0], Ino(pipefd[0]), why); }, "not the memory the owner named");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.0);
  close(pipefd[0]);
  close(pipefd[1]);
  // nothing there
  why.clear();
  EXPECT_FALSE(shm::Map(getpid(), 100000, 1, why));
  EXPECT_NE(why.find("cannot open"), std::string::npos) << why;
}

TEST(ShmMaps, OneFdWithTwoInodesIsRefusedAndAReplacedMappingStaysWhileHeld) {
  const int a = Memfd(kSize);
  {
    void *p = mmap(nullptr, kSize, PROT_READ | PROT_WRITE, MAP_SHARED, a, 0);
    ASSERT_NE(p, MAP_FAILED);
    std::memset(p, 1, kSize);
    munmap(p, kSize);
  }
  shm::Maps maps(getpid());
  std::vector<shm::MappingPtr> got;
  std::string why;
  ASSERT_TRUE(maps.Resolve({a}, {Ino(a)}, got, why)) << why;
  shm::MappingPtr held = got[0];  // a copy in flight holds it
  const uint64_t old = Ino(a);
  // a new, bigger file behind the same descriptor number
  const int b = Memfd(4 * kSize);
  ASSERT_EQ(dup2(b, a), a);
  close(b);
  const uint64_t now = Ino(a);
  ASSERT_NE(old, now);
  ExpectViolation([&] { maps.Resolve({a, a}, {old, now}, got, why); }, "with two different files");
  EXPECT_EQ(held->addr()[kSize - 1], 1);  // nothing unmapped by the refused grant
  ASSERT_TRUE(maps.Resolve({a}, {now}, got, why)) << why;
  EXPECT_EQ(got[0]->size(), 4 * kSize);
  EXPECT_EQ(maps.size(), 1U);
  EXPECT_EQ(held->addr()[0], 1);  // replaced in the table, still mapped for its holder
  close(a);
}

TEST(ShmSpans, EverySpanMustLieInItsMapping) {
  auto region = shm::Region::Create("shm-test", kSize);
  std::string why;
  shm::MappingPtr m = shm::Map(getpid(), region->fd(), region->ino(), why);
  ASSERT_TRUE(m) << why;
  auto spans = shm::Spans({m, m}, {0, kSize - 64}, {0, 32}, {32, 32});
  ASSERT_EQ(spans.size(), 4U);
  EXPECT_EQ(spans[3].iov_base, m->addr() + kSize - 32);
  ExpectViolation([&] { shm::Spans({m}, {kSize + 1}, {0}, {1}); }, "outside the mapping");
  ExpectViolation([&] { shm::Spans({m}, {kSize - 64}, {32}, {33}); }, "run past the shared mapping");
  ExpectViolation([&] { shm::Spans({m}, {64}, {UINT64_MAX - 8}, {16}); }, "run past the shared mapping");
  ExpectViolation([&] { shm::Spans({m}, {0, 0}, {0}, {1}); }, "does not match the request");
  uint8_t dst[8];
  EXPECT_THROW(shm::Copy({{dst, 8}}, {{region->addr(), 16}}), datadist::Error);  // lengths differ
}

TEST(ShmPays, FewSpansOrLongOnes) {
  EXPECT_TRUE(shm::Pays(4, {4096}));
  EXPECT_TRUE(shm::Pays(256, {64}));
  EXPECT_FALSE(shm::Pays(257, {64}));
  EXPECT_TRUE(shm::Pays(1000, {32 << 10}));
  EXPECT_FALSE(shm::Pays(1000, {(32 << 10) - 1}));
}

w::Hello ClientHello() {
  w::Hello h;
  h.cluster_id = kClient;
  h.pid = static_cast<uint32_t>(getpid());
  h.pid_ns = datadist::local::HostIdentity::Current().pid_ns;
  h.boot_id = datadist::local::HostIdentity::Current().boot_id;
  return h;
}

/// An owner whose cache 1 (4 tensors x 4 slots x 64 bytes) lies in one sealed memfd, tensors
/// a page apart, as a pool's.
class ShmOwner : public ::testing::Test {
 protected:
  void SetUp() override {
    ident.cluster_id = kOwner;
    region = shm::Region::Create("shm-owner", 4 * 4096);
    datadist::ShmPlace place;
    for (uint32_t t = 0; t < 4; ++t) {
      addrs.push_back(reinterpret_cast<uint64_t>(region->addr()) + t * 4096);
      for (int i = 0; i < 256; ++i) region->addr()[t * 4096 + i] = static_cast<uint8_t>(t * 64 + i);
      place.fds.push_back(region->fd());
      place.inos.push_back(region->ino());
      place.offsets.push_back(t * 4096);
    }
    datadist::Geometry g{4, 256, 4, 64, 0};
    datadist::CacheOptions opts;
    registry.AddAs(1, g, addrs, opts, place);
    server = std::make_unique<datadist::Server>(&registry, &ident);
    server->Start("127.0.0.1", 0, 256, 8);
    ASSERT_TRUE(server->serves_local());
  }
  void TearDown() override { server->Stop(); }
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
  std::pair<w::Header, std::vector<uint8_t>> Ask(datadist::Conn &c, const std::vector<uint8_t> &frame) {
    c.SendFrame(frame, After(2));
    std::vector<uint8_t> p;
    w::Header h = c.RecvFrame(p, After(2));
    return {h, p};
  }
  std::unique_ptr<shm::Region> region;
  std::vector<uint64_t> addrs;
  datadist::Registry registry;
  datadist::Identity ident;
  std::unique_ptr<datadist::Server> server;
};

TEST_F(ShmOwner, GrantsAndLeasesNameTheMemfdWhenAskedForShm) {
  auto c = datadist::local::Connect(datadist::local::Name(getpid(), kOwner), After(2));
  ASSERT_EQ(Ask(*c, w::EncodeHello(w::kHello, ClientHello(), 1)).first.type, w::kWelcome);
  w::Request q = Slot({3, 1}, 2, 8, 32);
  q.flags = w::kFlagGrant | w::kFlagShm;
  auto [h, p] = Ask(*c, w::EncodeRequest(w::kRead, q, 2));
  ASSERT_EQ(h.type, w::kShmGrant);
  w::ShmGrant g = w::DecodeShmGrant(p);
  ASSERT_EQ(g.fds.size(), 2U);
  EXPECT_EQ(g.fds[0], region->fd());
  EXPECT_EQ(g.inos[1], region->ino());
  EXPECT_EQ(g.offsets[0], 3 * 4096U + 2 * 64);  // the tensor's place in the memfd, plus the slot
  EXPECT_EQ(g.offsets[1], 1 * 4096U + 2 * 64);
  c->SendFrame(w::EncodeRelease({g.lease_id, true}, 0), After(2));
  q.flags = w::kFlagGrant;  // no SHM asked: addresses
  auto [h2, p2] = Ask(*c, w::EncodeRequest(w::kRead, q, 3));
  ASSERT_EQ(h2.type, w::kGrant);
  EXPECT_EQ(w::DecodeGrant(p2).bases[0], addrs[3] + 2 * 64);
  c->SendFrame(w::EncodeRelease({w::DecodeGrant(p2).lease_id, true}, 0), After(2));
  w::LeaseRequest lq;
  lq.kind = w::kCacheId;
  lq.a = 1;
  lq.flags = w::kFlagShm;
  w::CacheLease l = w::DecodeCacheLease(Ask(*c, w::EncodeLeaseRequest(lq, 4)).second);
  ASSERT_EQ(l.shm_fds.size(), 4U);
  EXPECT_EQ(l.shm_offsets[2], 2 * 4096U);
  EXPECT_EQ(l.shm_inos[0], region->ino());
  lq.flags = w::kFlagShm | w::kLeaseWrite;  // writes go by cross-memory attach
  l = w::DecodeCacheLease(Ask(*c, w::EncodeLeaseRequest(lq, 5)).second);
  EXPECT_TRUE(l.shm_fds.empty());
}

TEST_F(ShmOwner, PullsCopyFromTheMappedMemfdAndCmaWhenShmIsOff) {
  for (bool allow : {true, false}) {
    datadist::Link link(kOwner, "127.0.0.1", server->port(), ClientHello(), "", nullptr, true, 0);
    link.SetShm(allow, allow);
    link.Open(After(3));
    ASSERT_EQ(link.path(), datadist::Link::Path::kCma);
    EXPECT_STREQ(link.path_name(), allow ? "shm" : "cma");
    for (int round = 0; round < 2; ++round) {  // the first asks a lease, the next copy under it
      uint8_t a[32] = {}, b[32] = {};
      link.Read(Slot({3, 1}, 2, 8, 32), {{a, 32}, {b, 32}}, After(2));
      EXPECT_EQ(std::memcmp(a, region->addr() + 3 * 4096 + 2 * 64 + 8, 32), 0);
      EXPECT_EQ(std::memcmp(b, region->addr() + 1 * 4096 + 2 * 64 + 8, 32), 0);
      EXPECT_STREQ(link.last_moved(), allow ? "shm" : "cma");
    }
    // the owner's checks, made by the reader under the lease, refuse what the owner would
    uint8_t c[64] = {};
    EXPECT_THROW(link.Read(Slot({0}, 3, 32, 64), {{c, 64}}, After(2)), datadist::Error);
    for (uint8_t x : c) ASSERT_EQ(x, 0);
    link.Close(After(1), true);
  }
  registry.Remove(1, false, 5.0);
}

TEST_F(ShmOwner, AGrantedPullCopiesFromTheMapping) {
  // A CacheKey is never leased (the owner consumes it): each pull is granted.
  registry.BindKeys(1, {{5, 0, false}}, {2});
  for (bool allow : {true, false}) {
    datadist::Link link(kOwner, "127.0.0.1", server->port(), ClientHello(), "", nullptr, true, 0);
    link.SetShm(allow, false);
    link.Open(After(3));
    EXPECT_STREQ(link.path_name(), "cma");
    w::Request q = Slot({3, 1}, 0, 8, 32);
    q.kind = w::kCacheKey;
    q.a = 5;  // req_id 5 of model 0: slot 2
    q.b = 0;
    q.c = UINT64_MAX;
    uint8_t a[32] = {}, b[32] = {};
    link.Read(q, {{a, 32}, {b, 32}}, After(2));
    EXPECT_EQ(std::memcmp(a, region->addr() + 3 * 4096 + 2 * 64 + 8, 32), 0);
    EXPECT_EQ(std::memcmp(b, region->addr() + 1 * 4096 + 2 * 64 + 8, 32), 0);
    EXPECT_STREQ(link.last_moved(), allow ? "shm" : "cma");
    link.Close(After(1), true);
  }
  registry.Remove(1, false, 5.0);  // every grant was released
}

/// Descriptors of this process open on fence files (the owner's and the reader's views).
size_t FenceFds() {
  size_t n = 0;
  for (int fd = 0; fd < 4096; ++fd) {
    char buf[256];
    const std::string path = "/proc/self/fd/" + std::to_string(fd);
    const ssize_t got = readlink(path.c_str(), buf, sizeof(buf) - 1);
    if (got > 0 && std::string(buf, static_cast<size_t>(got)).find("datadist-fence") != std::string::npos) ++n;
  }
  return n;
}

// A reader of one cache per request keeps a bounded number of leases (each holds a descriptor
// on the owner's fence): revoked ones go, and the oldest beyond 64 (Python's MAX_LEASES).
TEST(Leases, AReaderKeepsABoundedNumberOfLeases) {
  datadist::Registry registry;
  datadist::Identity ident;
  ident.cluster_id = kOwner;
  std::vector<uint8_t> mem(80 * 256, 3);
  for (int64_t id = 1; id <= 80; ++id)
    registry.AddAs(id, datadist::Geometry{1, 256, 4, 64, 0}, {reinterpret_cast<uint64_t>(mem.data()) + (id - 1) * 256},
                   datadist::CacheOptions{});
  datadist::Server server(&registry, &ident);
  server.Start("127.0.0.1", 0, 256, 8);
  const size_t before = FenceFds();
  datadist::Link link(kOwner, "127.0.0.1", server.port(), ClientHello(), "", nullptr, true, 0);
  link.Open(After(3));
  uint8_t a[64] = {};
  for (uint64_t id = 1; id <= 80; ++id) {
    w::Request q;
    q.kind = w::kCacheId;
    q.a = id;
    q.b = 1;
    q.tensors = {0};
    q.offsets = {0};
    q.lengths = {64};
    link.Read(q, {{a, 64}}, After(2));
    EXPECT_EQ(a[63], 3);
    EXPECT_STREQ(link.last_moved(), "cma");  // under the lease
  }
  // the owner's 80 fences, and at most 64 views of them here
  EXPECT_LE(FenceFds() - before, 80U + 64U);
  EXPECT_GE(FenceFds() - before, 80U + 1U);
  for (int64_t id = 1; id <= 80; ++id) registry.Remove(id, false, 5.0);
  link.Close(After(1), true);
  server.Stop();
  EXPECT_EQ(FenceFds(), before);
}

// The C++ API's AllocateCache puts each cache in a sealed memfd (what a same-host reader maps).
TEST(ShmApi, AllocatedCachesLieInASealedMemfd) {
  LlmDataDist dd(kOwner, LlmRole::kPrompt);
  ASSERT_EQ(dd.Initialize(ddtest::Options()), LLM_SUCCESS);
  CacheDesc desc{};
  desc.placement = CachePlacement::kHost;
  desc.num_tensors = 3;
  desc.data_type = DT_UINT8;
  desc.shape = {4, 1000};
  Cache cache{};
  ASSERT_EQ(dd.AllocateCache(desc, cache), LLM_SUCCESS);
  ASSERT_EQ(cache.tensor_addrs.size(), 3U);
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  for (uint64_t a : cache.tensor_addrs) {
    EXPECT_EQ(a % page, 0U);                                                         // page-aligned tensors
    for (int i = 0; i < 4000; ++i) ASSERT_EQ(reinterpret_cast<uint8_t *>(a)[i], 0);  // zeroed
  }
  std::ifstream maps("/proc/self/maps");
  std::string line;
  bool found = false;
  while (std::getline(maps, line)) {
    const uint64_t lo = std::stoull(line.substr(0, line.find('-')), nullptr, 16);
    const uint64_t hi = std::stoull(line.substr(line.find('-') + 1, line.find(' ')), nullptr, 16);
    if (lo <= cache.tensor_addrs[0] && cache.tensor_addrs[0] < hi)
      found = line.find("memfd:datadist-cache") != std::string::npos;
  }
  EXPECT_TRUE(found) << "the allocated cache is not in a datadist memfd";
  EXPECT_EQ(dd.DeallocateCache(cache.cache_id), LLM_SUCCESS);
  dd.Finalize();
}

}  // namespace

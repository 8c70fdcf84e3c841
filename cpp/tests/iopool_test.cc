// Issue 23 item 5, "threads do not grow with links": connections are served by a fixed set of
// I/O threads (iopool.h). Before, the listener ran a thread per accepted connection and every
// link a thread for its reverse channel: 1,000 links in one process held ~2,000 threads.
#include "iopool.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "errors.h"
#include "link.h"
#include "registry.h"
#include "server.h"
#include "test_util.h"
#include "wire.h"

namespace {

using namespace llm_datadist;
namespace w = datadist::wire;
using datadist::After;
using ddtest::HostCache;

constexpr uint64_t kOwner = 1;

size_t Threads() {
  size_t n = 0;
  if (DIR *d = opendir("/proc/self/task")) {
    while (dirent *e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

/// The thread count before a test's threads: one thread started and joined first, so that a
/// sanitizer's own background thread (ThreadSanitizer starts one with the first thread) is
/// already counted.
size_t Baseline() {
  std::thread([] {}).join();
  return Threads();
}

long RssKiB() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return 0;
}

using ddtest::Seconds;

/// Raises the descriptor limit to `want` if the hard limit allows; false if it does not.
bool EnoughDescriptors(rlim_t want) {
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) != 0) return false;
  if (r.rlim_cur >= want) return true;
  if (r.rlim_max != RLIM_INFINITY && r.rlim_max < want) return false;
  r.rlim_cur = want;
  return setrlimit(RLIMIT_NOFILE, &r) == 0;
}

/// A task that reads `need` bytes a step and answers with the last plus one, on one end of a
/// socketpair.
class Echo : public datadist::IoPool::Task {
 public:
  explicit Echo(int fd) : conn_(fd, "pair") {}
  int fd() const override { return conn_.fd(); }
  bool Run(bool readable, datadist::Deadline &wake) override {
    if (!readable) {
      ++ticks;
      return false;
    }
    uint8_t got[8] = {};
    conn_.RecvAll(got, need, After(block_s));
    uint8_t b = static_cast<uint8_t>(got[need - 1] + 1);
    conn_.SendAll(&b, 1, After(1));
    wake = wake_after_s > 0 ? After(wake_after_s) : datadist::Deadline::max();
    return true;
  }
  void Cancel() override { conn_.Shutdown(); }
  std::atomic<int> ticks{0};
  size_t need = 1;          // bytes a step reads (at most 8)
  double block_s = 1;       // how long a step waits for them
  double wake_after_s = 0;  // > 0: ask for a timer step this long after each step

 private:
  datadist::Conn conn_;
};

struct Pair {
  int ours = -1, theirs = -1;
  Pair() {
    int sv[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    ours = sv[0];
    theirs = sv[1];
  }
  ~Pair() {
    if (theirs >= 0) close(theirs);
  }
  uint8_t Ask(uint8_t b) {
    EXPECT_EQ(write(theirs, &b, 1), 1);
    uint8_t got = 0;
    EXPECT_EQ(read(theirs, &got, 1), 1);
    return got;
  }
};

/// A task that waits for room to send (Interest EPOLLOUT): each step sends what the socket
/// takes of `left` bytes, non-blocking, and parks again until all went.
class Sender : public datadist::IoPool::Task {
 public:
  Sender(int fd, size_t bytes) : conn_(fd, "pair"), data_(bytes, 0x5a) { out_.iov = {{data_.data(), data_.size()}}; }
  int fd() const override { return conn_.fd(); }
  uint32_t Interest() const override { return EPOLLOUT; }
  bool Run(bool, datadist::Deadline &) override {
    ++steps;
    short want = 0;
    return !conn_.SendSome(out_, want);
  }
  void Cancel() override { conn_.Shutdown(); }
  std::atomic<int> steps{0};

 private:
  datadist::Conn conn_;
  std::vector<uint8_t> data_;
  datadist::Spans out_;
};

// A task parked for EPOLLOUT is woken when its peer makes room, not before, and holds no
// thread meanwhile (the pool's one thread serves another task); its answer arrives whole.
TEST(IoPool, ATaskParkedForRoomWakesWhenThePeerReads) {
  auto pool = std::make_shared<datadist::IoPool>(1);
  datadist::IoPool::Group group;
  Pair big, echo;
  auto sender = std::make_shared<Sender>(big.ours, 8 << 20);
  ASSERT_TRUE(pool->Park(group, sender));
  auto e = std::make_shared<Echo>(echo.ours);
  ASSERT_TRUE(pool->Park(group, e));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const int parked_steps = sender->steps;
  EXPECT_EQ(echo.Ask(4), 5);  // served by the one thread while the sender waits for room
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(sender->steps, parked_steps) << "woken with no room";
  std::vector<uint8_t> got(8 << 20);
  size_t at = 0;
  while (at < got.size()) {
    const ssize_t k = read(big.theirs, got.data() + at, got.size() - at);
    ASSERT_GT(k, 0);
    at += static_cast<size_t>(k);
  }
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](uint8_t b) { return b == 0x5a; }));
  EXPECT_GT(sender->steps, parked_steps);
  pool->Stop(group);
}

// The pool when no thread can be started (the process at its thread limit; here the test
// hook): it throws std::system_error; IoGroup::Add then throws it, and the next Add tries
// again and serves.
TEST(IoPool, ThreadsThatCannotStart) {
  datadist::IoPool::FailThreadStartsForTest(1000);
  EXPECT_THROW(datadist::IoPool(2), std::system_error);
  {
    datadist::IoGroup group;  // the shared pool, made at the first Add
    Pair p;
    EXPECT_THROW(group.Add(std::make_shared<Echo>(p.ours)), std::system_error);
    datadist::IoPool::FailThreadStartsForTest(0);
    Pair q;
    ASSERT_TRUE(group.Add(std::make_shared<Echo>(q.ours)));
    EXPECT_EQ(q.Ask(1), 2);
  }
}

TEST(IoPool, ServesManyParkedConnectionsOnItsFixedThreads) {
  ASSERT_TRUE(EnoughDescriptors(4096));
  const size_t before = Baseline();
  auto pool = std::make_shared<datadist::IoPool>(2);
  EXPECT_EQ(Threads(), before + 2);
  datadist::IoGroup group(pool);
  std::vector<std::unique_ptr<Pair>> pairs;
  for (int i = 0; i < 500; ++i) {
    pairs.push_back(std::make_unique<Pair>());
    ASSERT_TRUE(group.Add(std::make_shared<Echo>(pairs.back()->ours)));
  }
  EXPECT_EQ(pool->tasks(), 500u);
  EXPECT_EQ(Threads(), before + 2);
  for (int round = 0; round < 3; ++round)  // each served again and again: parked after each step
    for (size_t i = 0; i < pairs.size(); ++i)
      ASSERT_EQ(pairs[i]->Ask(static_cast<uint8_t>(i + round)), static_cast<uint8_t>(i + round + 1));
  // a peer that closes: its task ends (EOF is readable), the pool lets it go
  close(pairs[7]->theirs);
  pairs[7]->theirs = -1;
  for (int i = 0; i < 100 && pool->tasks() != 499; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(pool->tasks(), 499u);
  group.Stop();  // parked ones go at once
  EXPECT_EQ(pool->tasks(), 0u);
  EXPECT_FALSE(group.Add(std::make_shared<Echo>(Pair().ours)));  // stopped: refused
  pool.reset();
  EXPECT_EQ(Threads(), before);  // the last holder joined the threads
}

TEST(IoPool, TimerStepsComeWhenAsked) {
  auto pool = std::make_shared<datadist::IoPool>(2);
  datadist::IoGroup group(pool);
  Pair p;
  auto echo = std::make_shared<Echo>(p.ours);
  echo->wake_after_s = 0.05;
  ASSERT_TRUE(group.Add(echo));
  EXPECT_EQ(p.Ask(1), 2);  // the step asks for a timer step 50 ms on; that one ends the task
  const auto t0 = std::chrono::steady_clock::now();
  while (echo->ticks == 0 && Seconds(t0) < 5) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(echo->ticks, 1);
  EXPECT_LT(Seconds(t0), 2.0);
  for (int i = 0; i < 100 && pool->tasks() != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(pool->tasks(), 0u);
}

TEST(IoPool, StopWakesAStepBlockedOnItsPeerAndOthersAreServedMeanwhile) {
  auto pool = std::make_shared<datadist::IoPool>(2);
  datadist::IoGroup stuck_group(pool), group(pool);
  Pair stuck, live;
  auto blocked = std::make_shared<Echo>(stuck.ours);
  blocked->need = 2;
  blocked->block_s = 60;  // a peer that sent half a request and stalls: the step waits for the rest
  ASSERT_TRUE(stuck_group.Add(blocked));
  ASSERT_TRUE(group.Add(std::make_shared<Echo>(live.ours)));
  ASSERT_EQ(write(stuck.theirs, "\x01", 1), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // It holds one of the two threads, up to its deadline; the other still serves.
  for (int i = 0; i < 20; ++i) EXPECT_EQ(live.Ask(static_cast<uint8_t>(i)), static_cast<uint8_t>(i + 1));
  const auto t0 = std::chrono::steady_clock::now();
  stuck_group.Stop();  // the stalled step is woken (its socket shut down), not waited out
  EXPECT_LT(Seconds(t0), 1.0);
  EXPECT_EQ(pool->tasks(), 1u);
  EXPECT_EQ(live.Ask(40), 41);
}

TEST(IoPool, DefaultThreadsFollowTheEnvironmentWithinBounds) {
  const char *was = std::getenv("DATADIST_IO_THREADS");
  const std::string saved = was ? was : "";
  setenv("DATADIST_IO_THREADS", "3", 1);
  EXPECT_EQ(datadist::IoPool::DefaultThreads(), 3u);
  const size_t hw = std::max<size_t>(2, std::min<size_t>(8, std::thread::hardware_concurrency()));
  for (const char *bad : {"0", "65", "two", "", "4x"}) {
    setenv("DATADIST_IO_THREADS", bad, 1);
    EXPECT_EQ(datadist::IoPool::DefaultThreads(), hw) << "'" << bad << "'";
  }
  if (was)
    setenv("DATADIST_IO_THREADS", saved.c_str(), 1);
  else
    unsetenv("DATADIST_IO_THREADS");
}

// A process that forks while the shared pool is up: the child inherits the pool object but
// none of its threads. Before, its listener parked connections nobody served (its links
// timed out); it now makes a pool of its own.
TEST(IoPool, AForkedChildServesWithAPoolOfItsOwn) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer does not support starting threads after a multi-threaded fork";
#endif
  const std::shared_ptr<datadist::IoPool> parents = datadist::IoPool::Shared();
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int code = 1;
    try {
      HostCache owned{1, {2, 64}};
      owned.Fill(9);
      datadist::Registry registry;
      registry.Add(owned.desc, owned.addrs, {});
      datadist::Identity ident;
      ident.cluster_id = kOwner;
      ident.serve_local = false;
      datadist::Server server(&registry, &ident);
      server.Start("127.0.0.1", 0);
      w::Hello hello;
      hello.cluster_id = 70;
      datadist::Link link(kOwner, "127.0.0.1", server.port(), hello, "", nullptr, /*same_host=*/false);
      link.Open(After(3));
      w::Request q;
      q.kind = w::kCacheId;
      q.a = 1;
      q.b = 0;
      q.tensors = {0};
      q.offsets = {0};
      q.lengths = {64};
      uint8_t got[64] = {};
      link.Read(q, {{got, 64}}, After(3));
      code = std::memcmp(got, owned.T(0), 64) == 0 ? 0 : 2;
      link.Close(After(1), true);
      server.Stop();
    } catch (...) {
      code = 3;
    }
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the forked child's listener did not serve its link";
}

// A listener on a pool of two threads: a peer that sent half a request holds neither (it is
// parked until the rest comes, or its frame's 30 s pass); a link is served meanwhile; Stop
// closes the stalled one at once rather than waiting 30 s for its frame.
TEST(Server, AStalledPeerHoldsOneThreadAndStopWakesIt) {
  HostCache owned{1, {2, 64}};
  owned.Fill(5);
  datadist::Registry registry;
  ASSERT_EQ(registry.Add(owned.desc, owned.addrs, {}), 1);
  datadist::Identity ident;
  ident.cluster_id = kOwner;
  ident.serve_local = false;
  auto pool = std::make_shared<datadist::IoPool>(2);
  datadist::Server server(&registry, &ident, nullptr, pool);
  server.Start("127.0.0.1", 0);
  auto stalled = datadist::Conn::Connect("127.0.0.1", server.port(), After(2));
  w::Hello hello;
  hello.cluster_id = 50;
  stalled->SendFrame(w::EncodeHello(w::kHello, hello, 1), After(2));
  std::vector<uint8_t> payload;
  ASSERT_EQ(stalled->RecvFrame(payload, After(2)).type, w::kWelcome);
  std::vector<uint8_t> ping = w::EncodeU64(w::kPing, 7, 2);
  stalled->SendAll(ping.data(), 5, After(2));  // five bytes of a header, then nothing
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  hello.cluster_id = 51;
  datadist::Link link(kOwner, "127.0.0.1", server.port(), hello, "", nullptr, /*same_host=*/false);
  link.Open(After(5));
  w::Request q;
  q.kind = w::kCacheId;
  q.a = 1;
  q.b = 1;
  q.tensors = {0};
  q.offsets = {0};
  q.lengths = {64};
  for (int i = 0; i < 10; ++i) {
    uint8_t got[64] = {};
    link.Read(q, {{got, 64}}, After(5));
    ASSERT_EQ(std::memcmp(got, owned.T(0) + 64, 64), 0);
  }
  EXPECT_EQ(server.connections(), 2u);
  const auto t0 = std::chrono::steady_clock::now();
  server.Stop();
  EXPECT_LT(Seconds(t0), 2.0);
  EXPECT_EQ(pool->tasks(), 0u);
  uint8_t b = 0;
  EXPECT_LE(recv(stalled->fd(), &b, 1, 0), 0);  // closed by the listener
}

// Peers that send part of a frame and stop (half a HELLO before the handshake, half a PING
// after it) hold no pool thread: their connections stay parked until the rest arrives, so a
// pool of ONE thread still serves a good link meanwhile (before: each held the thread for the
// handshake's 10 s or the frame's 30 s, and the link timed out); the rest, when it comes, is
// served; past the handshake's deadline a partial HELLO is closed.
TEST(Server, PartialFramesHoldNoThread) {
  HostCache owned{1, {2, 64}};
  owned.Fill(6);
  datadist::Registry registry;
  ASSERT_EQ(registry.Add(owned.desc, owned.addrs, {}), 1);
  datadist::Identity ident;
  ident.cluster_id = kOwner;
  ident.serve_local = false;
  auto pool = std::make_shared<datadist::IoPool>(1);
  datadist::Server server(&registry, &ident, nullptr, pool);
  server.Start("127.0.0.1", 0);
  w::Hello hello;
  std::vector<std::unique_ptr<datadist::Conn>> partial;
  for (int i = 0; i < 4; ++i) {  // 7 bytes of a HELLO's header
    auto c = datadist::Conn::Connect("127.0.0.1", server.port(), After(2));
    hello.cluster_id = 60 + i;
    std::vector<uint8_t> f = w::EncodeHello(w::kHello, hello, 1);
    c->SendAll(f.data(), 7, After(2));
    partial.push_back(std::move(c));
  }
  auto linked = datadist::Conn::Connect("127.0.0.1", server.port(), After(2));
  hello.cluster_id = 70;
  linked->SendFrame(w::EncodeHello(w::kHello, hello, 1), After(2));
  std::vector<uint8_t> payload;
  ASSERT_EQ(linked->RecvFrame(payload, After(2)).type, w::kWelcome);
  std::vector<uint8_t> ping = w::EncodeU64(w::kPing, 9, 2);
  linked->SendAll(ping.data(), 5, After(2));  // five bytes of a PING, then nothing (yet)
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  hello.cluster_id = 71;
  datadist::Link link(kOwner, "127.0.0.1", server.port(), hello, "", nullptr, /*same_host=*/false);
  link.Open(After(3));
  w::Request q;
  q.kind = w::kCacheId;
  q.a = 1;
  q.b = 1;
  q.tensors = {0};
  q.offsets = {0};
  q.lengths = {64};
  uint8_t got[64] = {};
  link.Read(q, {{got, 64}}, After(3));
  EXPECT_EQ(std::memcmp(got, owned.T(0) + 64, 64), 0);
  linked->SendAll(ping.data() + 5, ping.size() - 5, After(2));  // the rest: answered
  w::Header h = linked->RecvFrame(payload, After(3));
  EXPECT_EQ(h.type, w::kPong);
  EXPECT_EQ(w::DecodeU64(payload), 9u);
  server.Stop();
  EXPECT_EQ(pool->tasks(), 0u);
}

/// A TCP connection to 127.0.0.1:port from the loopback address 127.0.0.<host> (a listener
/// counts its budgets per address); -1 if it cannot be made.
int ConnectFrom(int host, uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl((127u << 24) | static_cast<uint32_t>(host));
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  to.sin_port = htons(port);
  if (bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof(a)) != 0 ||
      connect(fd, reinterpret_cast<sockaddr *>(&to), sizeof(to)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Clients that connect and never say HELLO cost the listener no thread (before: one each, for
// the handshake's 10 s); a link made meanwhile is served; Stop closes them at once. (They come
// from 15 loopback addresses: one address may hold 16 connections in their handshake.)
TEST(Server, SilentConnectionsCostNoThread) {
  datadist::Registry registry;
  datadist::Identity ident;
  ident.cluster_id = kOwner;
  ident.serve_local = false;
  const std::shared_ptr<datadist::IoPool> pool = datadist::IoPool::Shared();  // its threads counted below
  datadist::Server server(&registry, &ident);
  server.Start("127.0.0.1", 0, 1024, 1024);
  const size_t threads = Threads();
  std::vector<std::unique_ptr<datadist::Conn>> silent;
  for (int i = 0; i < 240; ++i) {
    const int fd = ConnectFrom(2 + i / 16, server.port());
    ASSERT_GE(fd, 0);
    silent.push_back(std::make_unique<datadist::Conn>(fd, "silent"));
  }
  for (int i = 0; i < 500 && server.connections() != 240; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(server.connections(), 240u);
  EXPECT_EQ(server.refused(), 0u);
  EXPECT_EQ(Threads(), threads);
  w::Hello hello;
  hello.cluster_id = 60;
  datadist::Link link(kOwner, "127.0.0.1", server.port(), hello, "", nullptr, /*same_host=*/false);
  link.Open(After(5));
  EXPECT_EQ(Threads(), threads);
  const auto t0 = std::chrono::steady_clock::now();
  server.Stop();
  EXPECT_LT(Seconds(t0), 2.0);
  uint8_t b = 0;
  EXPECT_LE(recv(silent[0]->fd(), &b, 1, 0), 0);  // closed by the listener
}

// A listener with 1,000 linked clients (each with a reverse channel: 4,000 sockets in this
// process) holds its accept thread and the pool's threads, whatever the link count; pulls on
// several links and pushes over several reverse channels still move the right bytes.
TEST(Scale, AThousandLinksKeepTheThreadCountBounded) {
  constexpr size_t kLinks = 1000;
  if (!EnoughDescriptors(4 * kLinks + 512)) GTEST_SKIP() << "the descriptor limit is below " << 4 * kLinks + 512;
  const size_t threads_before = Baseline();
  HostCache owned{2, {4, 256}};
  owned.Fill(11);
  datadist::Registry owner_registry;
  ASSERT_EQ(owner_registry.Add(owned.desc, owned.addrs, {}), 1);
  HostCache pushed{1, {kLinks, 16}};  // the clients' cache: slot i is pushed by link i's listener end
  datadist::Registry client_registry;
  ASSERT_EQ(client_registry.Add(pushed.desc, pushed.addrs, {}), 1);
  datadist::Identity ident;
  ident.cluster_id = kOwner;
  ident.serve_local = false;
  std::mutex mu;
  std::map<uint64_t, std::shared_ptr<datadist::Link>> reverse_ends;
  datadist::Server server(
      &owner_registry, &ident,
      [&](datadist::Server &, uint64_t cluster, std::unique_ptr<datadist::Conn> conn, const std::vector<uint8_t> &last,
          const std::string &token, const std::string &peer, bool eager) {
        auto link = std::make_shared<datadist::Link>(cluster, std::move(conn), token, peer, eager);
        link->Adopted(
            [&] {
              std::lock_guard<std::mutex> lock(mu);
              reverse_ends[cluster] = link;
              return std::string();
            },
            last, After(10));
      });
  server.Start("127.0.0.1", 0, 4 * kLinks, 4 * kLinks);
  const size_t pool_threads = datadist::IoPool::Shared()->threads();
  const long rss_before = RssKiB();
  std::vector<std::unique_ptr<datadist::Link>> links;
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < kLinks; ++i) {
    w::Hello hello;
    hello.cluster_id = 100 + i;
    hello.pid = static_cast<uint32_t>(getpid());
    links.push_back(std::make_unique<datadist::Link>(kOwner, "127.0.0.1", server.port(), hello, "", &client_registry,
                                                     /*same_host=*/false));
    links.back()->Open(After(10));
  }
  const double link_s = Seconds(t0);
  const long rss_after = RssKiB();
  const size_t threads = Threads();
  {
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_EQ(reverse_ends.size(), kLinks);
  }
  // The control channels (the reverse ones were handed on; the last may still be finishing
  // its hand-over when its client's Open returns).
  for (int i = 0; i < 500 && server.connections() != kLinks; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(server.connections(), kLinks);
  // The listener's accept thread, its adopter threads (Server::Adopt: one while adoptions are
  // quick, a few when one finishes as the next comes) and the pool's threads, nothing per
  // link (before: +2,000).
  const size_t bound = threads_before + pool_threads + 1 + datadist::Server::kAdopters;
  EXPECT_LE(threads, bound) << threads_before << " threads before";
  std::printf(
      "[scale] %zu links: %zu threads (%zu before, pool %zu); RSS +%ld KiB (%.1f KiB per link, both ends); "
      "linked in %.2f s\n",
      kLinks, threads, threads_before, pool_threads, rss_after - rss_before,
      static_cast<double>(rss_after - rss_before) / kLinks, link_s);
  // Pulls on several links, pushes over several reverse channels (served parked by the
  // clients' side): the right bytes.
  for (size_t i : {size_t{0}, size_t{1}, kLinks / 3, kLinks / 2, kLinks - 1}) {
    w::Request q;
    q.kind = w::kCacheId;
    q.a = 1;
    q.b = i % 4;
    q.tensors = {1, 0};
    q.offsets = {8};
    q.lengths = {64};
    uint8_t a[64] = {}, b[64] = {};
    links[i]->Read(q, {{a, 64}, {b, 64}}, After(5));
    EXPECT_EQ(std::memcmp(a, owned.T(1) + (i % 4) * 256 + 8, 64), 0) << "link " << i;
    EXPECT_EQ(std::memcmp(b, owned.T(0) + (i % 4) * 256 + 8, 64), 0) << "link " << i;
    uint8_t bytes[16];
    for (size_t k = 0; k < sizeof(bytes); ++k) bytes[k] = static_cast<uint8_t>(i * 7 + k);
    w::Request push;
    push.kind = w::kCacheId;
    push.a = 1;
    push.b = i;
    push.tensors = {0};
    push.offsets = {0};
    push.lengths = {16};
    std::shared_ptr<datadist::Link> back;
    {
      std::lock_guard<std::mutex> lock(mu);
      back = reverse_ends.at(100 + i);
    }
    back->Write(push, {{bytes, 16}}, After(5));
    EXPECT_EQ(std::memcmp(pushed.T(0) + i * 16, bytes, 16), 0) << "reverse channel " << i;
  }
  EXPECT_LE(Threads(), bound);
  // Every link says BYE: the listener's connections end, and so do the reverse channels.
  for (auto &l : links) l->Close(After(5), false);
  links.clear();
  for (int i = 0; i < 500 && server.connections() != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(server.connections(), 0u);
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto &kv : reverse_ends) EXPECT_TRUE(kv.second->Gone()) << "reverse end " << kv.first;
    reverse_ends.clear();
  }
  server.Stop();
  EXPECT_EQ(Threads(), threads_before);  // the shared pool's last holder went: its threads joined
}

// Link::serial tells a link that replaced another under the same cluster id from the one a
// caller saw (NativeLink compares by it): every link gets its own, later ones larger, and one
// freed is never handed out again.
TEST(LinkSerial, EveryLinkHasItsOwnNeverReused) {
  w::Hello hello;
  uint64_t first = 0;
  {
    datadist::Link gone(kOwner, "127.0.0.1", 1, hello, "", nullptr, /*same_host=*/false);
    first = gone.serial();
  }
  datadist::Link a(kOwner, "127.0.0.1", 1, hello, "", nullptr, /*same_host=*/false);
  datadist::Link b(kOwner, "127.0.0.1", 1, hello, "", nullptr, /*same_host=*/false);
  EXPECT_NE(first, 0u);
  EXPECT_GT(a.serial(), first);
  EXPECT_GT(b.serial(), a.serial());
}

}  // namespace

// Conn's bulk transfers (net.cc, kBulkMin): the rest of a transfer the socket cannot finish at
// once waits in the kernel (O_NONBLOCK off, recvmsg(MSG_WAITALL), sends in 4 MiB calls), as
// Python's channel does, instead of a poll and a call per buffer-full; the deadline, a
// Shutdown from another thread and the socket's non-blocking mode afterwards are as before.
#include "net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "blocking.h"
#include "errors.h"

namespace {

using datadist::Conn;

// A connected loopback TCP pair: (a Conn, the peer's raw blocking fd).
std::pair<std::unique_ptr<Conn>, int> Pair() {
  int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(lfd, reinterpret_cast<sockaddr *>(&a), sizeof(a)), 0);
  EXPECT_EQ(listen(lfd, 1), 0);
  socklen_t len = sizeof(a);
  getsockname(lfd, reinterpret_cast<sockaddr *>(&a), &len);
  int cfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  EXPECT_EQ(connect(cfd, reinterpret_cast<sockaddr *>(&a), sizeof(a)), 0);
  int peer = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
  close(lfd);
  return {std::make_unique<Conn>(cfd, "test"), peer};
}

bool NonBlocking(int fd) { return fcntl(fd, F_GETFL, 0) & O_NONBLOCK; }

// Waits up to 10 s for `cond`.
template <typename Cond>
bool Eventually(Cond cond) {
  for (int i = 0; i < 1000; ++i) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return cond();
}

std::vector<uint8_t> Bytes(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 131 + seed + (i >> 12));
  return v;
}

void SendRaw(int fd, const uint8_t *p, size_t n) {
  while (n) {
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    ASSERT_GT(k, 0);
    p += k;
    n -= static_cast<size_t>(k);
  }
}

TEST(Net, ABulkReceiveWaitsInTheKernelThenTheSocketIsNonBlockingAgain) {
  auto [conn, peer] = Pair();
  const int fd = conn->fd();
  ASSERT_TRUE(NonBlocking(fd));
  const auto src = Bytes(8 << 20, 7);
  std::vector<uint8_t> a(3 << 20), b(5 << 20);
  std::atomic<bool> done{false};
  std::thread reader([&] {
    conn->RecvV({{a.data(), a.size()}, {b.data(), b.size()}}, datadist::After(60));
    done = true;
  });
  SendRaw(peer, src.data(), 64 << 10);  // the first bytes: the rest is more than kBulkMin
  // The reader cannot be done without the rest: it waits for it inside the call, not in poll.
  EXPECT_TRUE(Eventually([&] { return !NonBlocking(fd); })) << "the bulk receive never blocked";
  EXPECT_FALSE(done);
  SendRaw(peer, src.data() + (64 << 10), src.size() - (64 << 10));
  reader.join();
  EXPECT_TRUE(NonBlocking(fd));
  EXPECT_TRUE(std::equal(a.begin(), a.end(), src.begin()));
  EXPECT_TRUE(std::equal(b.begin(), b.end(), src.begin() + a.size()));
  close(peer);
}

TEST(Net, ABulkSendWaitsInTheKernelThenTheSocketIsNonBlockingAgain) {
  auto [conn, peer] = Pair();
  const int fd = conn->fd();
  const auto src = Bytes(24 << 20, 3);  // more than loopback buffers hold: the sender must wait
  std::thread writer([&] { conn->SendV({{const_cast<uint8_t *>(src.data()), src.size()}}, datadist::After(60)); });
  EXPECT_TRUE(Eventually([&] { return !NonBlocking(fd); })) << "the bulk send never blocked";
  std::vector<uint8_t> got(src.size());
  size_t n = 0;
  while (n < got.size()) {
    ssize_t k = recv(peer, got.data() + n, got.size() - n, 0);
    ASSERT_GT(k, 0);
    n += static_cast<size_t>(k);
  }
  writer.join();
  EXPECT_TRUE(NonBlocking(fd));
  EXPECT_EQ(got, src);
  close(peer);
}

TEST(Net, TheLocalChannelsUnixSocketsMoveBulkBytesTheSameWay) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  Conn reader(sv[0], "local a"), writer(sv[1], "local b");
  const auto src = Bytes(16 << 20, 5);
  std::vector<uint8_t> a(1 << 20), b(15 << 20);
  std::thread sender([&] { writer.SendV({{const_cast<uint8_t *>(src.data()), src.size()}}, datadist::After(60)); });
  reader.RecvV({{a.data(), a.size()}, {b.data(), b.size()}}, datadist::After(60));
  sender.join();
  EXPECT_TRUE(NonBlocking(sv[0]) && NonBlocking(sv[1]));
  EXPECT_TRUE(std::equal(a.begin(), a.end(), src.begin()));
  EXPECT_TRUE(std::equal(b.begin(), b.end(), src.begin() + a.size()));
}

TEST(Net, ADeadlineStillEndsABulkReceiveFromAStalledPeer) {
  auto [conn, peer] = Pair();
  const auto src = Bytes(1 << 20, 1);
  std::vector<uint8_t> dst(4 << 20);
  SendRaw(peer, src.data(), src.size());  // a quarter, then nothing
  const auto t0 = datadist::Clock::now();
  try {
    conn->RecvV({{dst.data(), dst.size()}}, datadist::After(0.5));
    FAIL() << "no timeout";
  } catch (const datadist::Error &e) {
    EXPECT_EQ(e.code(), llm_datadist::LLM_TIMEOUT) << e.what();
  }
  const double took = std::chrono::duration<double>(datadist::Clock::now() - t0).count();
  EXPECT_GE(took, 0.45);
  EXPECT_LT(took, 5.0);
  EXPECT_TRUE(conn->closed());
  close(peer);
}

TEST(Net, AShutdownFromAnotherThreadWakesABlockedBulkReceive) {
  auto [conn, peer] = Pair();
  const int fd = conn->fd();
  const auto src = Bytes(1 << 20, 2);
  std::vector<uint8_t> dst(4 << 20);
  SendRaw(peer, src.data(), src.size());
  std::thread stopper([&] {
    Eventually([&] { return !NonBlocking(fd); });
    conn->Shutdown();
  });
  try {
    conn->RecvV({{dst.data(), dst.size()}}, datadist::After(60));
    FAIL() << "the shutdown did not end the receive";
  } catch (const datadist::Error &e) {
    EXPECT_EQ(e.code(), llm_datadist::LLM_LINK_FAILED) << e.what();
  }
  stopper.join();
  close(peer);
}

// The "about to block" hook (blocking.h) a face installs for one call (the Python binding's
// GIL, cpp/python/gil.h): a wait that ends within the hook's budget keeps the caller's hold (the
// hook never runs); a longer one runs it once, right before the real wait, and the deadline
// still ends that wait; a bulk rest lets go at once, before it waits in the kernel; a thread
// with no hook (every core thread) waits as ever.
class CountingHook final : public datadist::blocking::Hook {
 public:
  explicit CountingHook(std::chrono::microseconds b) { budget = b; }
  void Blocking() noexcept override { ++calls; }
  int calls = 0;
};

TEST(Net, AnAnswerWithinTheHooksBudgetKeepsTheCallersHold) {
  auto [conn, peer] = Pair();
  CountingHook hook(std::chrono::seconds(5));
  const auto src = Bytes(16 << 10, 4);
  std::thread owner([&, fd = peer] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the answer is not there yet
    SendRaw(fd, src.data(), src.size());
  });
  std::vector<uint8_t> dst(src.size());
  {
    datadist::blocking::Scope scope(&hook);
    conn->RecvAll(dst.data(), dst.size(), datadist::After(30));
    EXPECT_TRUE(datadist::blocking::Pending());  // still installed, never run
  }
  owner.join();
  EXPECT_FALSE(datadist::blocking::Pending());  // uninstalled with its scope
  EXPECT_EQ(hook.calls, 0);
  EXPECT_EQ(dst, src);
  close(peer);
}

TEST(Net, AWaitPastTheBudgetLetsGoOnceAndTheDeadlineStillEndsIt) {
  auto [conn, peer] = Pair();
  CountingHook hook(std::chrono::milliseconds(1));
  uint8_t head[24];
  const auto t0 = datadist::Clock::now();
  {
    datadist::blocking::Scope scope(&hook);
    try {
      conn->RecvAll(head, sizeof(head), datadist::After(0.3));  // a peer that never answers
      FAIL() << "no timeout";
    } catch (const datadist::Error &e) {
      EXPECT_EQ(e.code(), llm_datadist::LLM_TIMEOUT) << e.what();
    }
  }
  const double took = std::chrono::duration<double>(datadist::Clock::now() - t0).count();
  EXPECT_EQ(hook.calls, 1);
  EXPECT_GE(took, 0.25);
  EXPECT_LT(took, 5.0);
  close(peer);
}

TEST(Net, ABulkRestLetsGoBeforeItWaitsInTheKernel) {
  auto [conn, peer] = Pair();
  CountingHook hook(std::chrono::seconds(30));  // a budget it must not wait out
  const auto src = Bytes(1 << 20, 6);
  std::thread owner([&, fd = peer] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    SendRaw(fd, src.data(), src.size());
  });
  std::vector<uint8_t> dst(src.size());
  const auto t0 = datadist::Clock::now();
  {
    datadist::blocking::Scope scope(&hook);
    conn->RecvAll(dst.data(), dst.size(), datadist::After(30));
  }
  const double took = std::chrono::duration<double>(datadist::Clock::now() - t0).count();
  owner.join();
  EXPECT_EQ(hook.calls, 1);
  EXPECT_LT(took, 10.0);
  EXPECT_EQ(dst, src);
  close(peer);
}

TEST(Net, AThreadWithNoHookWaitsAsEver) {
  auto [conn, peer] = Pair();
  EXPECT_FALSE(datadist::blocking::Pending());
  datadist::blocking::AboutToBlock();  // no hook: nothing to run
  const auto src = Bytes(64, 8);
  std::thread owner([&, fd = peer] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    SendRaw(fd, src.data(), src.size());
  });
  std::vector<uint8_t> dst(src.size());
  conn->RecvAll(dst.data(), dst.size(), datadist::After(30));
  owner.join();
  EXPECT_EQ(dst, src);
  close(peer);
}

// The non-blocking steps a served connection uses (server.cc): none waits for the peer. A send
// larger than the socket takes stops with POLLOUT and resumes where it stopped; a read with
// nothing there returns 0 with POLLIN; the bytes arrive whole and in order; EOF throws.
TEST(Net, NonBlockingStepsNeverWaitAndResumeWhereTheyStopped) {
  auto [conn, peer] = Pair();
  const auto src = Bytes(16 << 20, 3);
  datadist::Spans out;
  out.iov = {{const_cast<uint8_t *>(src.data()), 1000}, {const_cast<uint8_t *>(src.data()) + 1000, src.size() - 1000}};
  short want = 0;
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(conn->SendSome(out, want));  // the peer reads nothing yet: the socket fills
  EXPECT_EQ(want, POLLOUT);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
  std::vector<uint8_t> got(src.size());
  std::thread reader([&, fd = peer] {
    size_t at = 0;
    while (at < got.size()) {
      ssize_t k = recv(fd, got.data() + at, got.size() - at, 0);
      if (k <= 0) break;
      at += static_cast<size_t>(k);
    }
  });
  while (!conn->SendSome(out, want, 1 << 20)) {  // a share at a time, waiting as a pool would
    pollfd p{conn->fd(), want, 0};
    ASSERT_GE(poll(&p, 1, 5000), 0);
  }
  reader.join();
  EXPECT_EQ(got, src);
  uint8_t b[4];
  want = 0;
  EXPECT_EQ(conn->ReadSome(b, sizeof b, want), 0u);
  EXPECT_EQ(want, POLLIN);
  const uint8_t hello[3] = {1, 2, 3};
  SendRaw(peer, hello, 3);
  ASSERT_TRUE(Eventually([&] { return conn->WaitReadable(0); }));
  datadist::Spans in;
  uint8_t two[2] = {}, one[1] = {};
  in.iov = {{two, 2}, {one, 1}};
  EXPECT_TRUE(conn->RecvSome(in, want));
  EXPECT_EQ(two[0], 1);
  EXPECT_EQ(two[1], 2);
  EXPECT_EQ(one[0], 3);
  close(peer);
  ASSERT_TRUE(Eventually([&] { return conn->WaitReadable(0); }));
  EXPECT_THROW(conn->ReadSome(b, sizeof b, want), datadist::Error);  // EOF: closed
  EXPECT_TRUE(conn->closed());
}

}  // namespace

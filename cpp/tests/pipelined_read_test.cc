// Issued pulls pipelined on one link (Session::Submit, Link::ReadPipelined): several issued
// pulls waiting for the same TCP link have their READs in flight together, the answers read in
// order, each pull with its own task, outcome and deadline. The owner's side (server.cc) is
// checked to serve what arrives that way: requests in one send, an ERROR between them. The
// client's side is driven against a fake owner that speaks the wire by hand and counts how many
// READs were waiting with it when it answered each (1 at most on the code before, which ran
// the pulls of one link one round trip after another).
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "errors.h"
#include "iopool.h"
#include "link.h"
#include "net.h"
#include "registry.h"
#include "server.h"
#include "session.h"
#include "test_util.h"
#include "wire.h"

namespace {

using namespace llm_datadist;
namespace w = datadist::wire;
using datadist::After;

constexpr uint64_t kFakeOwner = 9301, kReader = 9302, kRealOwner = 9303;

// The owner's byte at `offset` of its one tensor (the fake and the real owner alike).
uint8_t At(uint64_t offset) { return static_cast<uint8_t>(offset * 131 + (offset >> 12) + 7); }

/// A READ of `length` bytes from `offset` of tensor 0 of cache `cache`.
w::Request Span(uint64_t offset, uint64_t length, uint64_t cache = 1) {
  w::Request q;
  q.kind = w::kCacheId;
  q.a = cache;
  q.tensors = {0};
  q.offsets = {offset};
  q.lengths = {length};
  return q;
}

/// A fake owner on a thread: connections one after another (a reconnect is served too),
/// HELLO answered by a WELCOME of another host (the link stays on TCP, no reverse channel),
/// then READs of tensor 0 answered in order with READ_DATA and the bytes At() gives. Before
/// answering, it takes the READs that arrive within `gather_s`, and records how many were
/// waiting (max_waiting). `error_at`: that READ (counted from 0 over the owner's life) is
/// answered ERROR LLM_KV_CACHE_NOT_EXIST; `die_after`: after that many answers the connection
/// and the listener close (nothing answers again); `stall_after`: after that many answers
/// nothing more is answered (the connection stays until the reader closes it); `hold_at`:
/// that READ is answered `hold_s` late.
class FakeOwner {
 public:
  struct Options {
    double gather_s = 0.02;
    int error_at = -1;
    int die_after = -1;
    int stall_after = -1;
    int hold_at = -1;
    double hold_s = 0;
  };
  explicit FakeOwner(Options o) : o_(o) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr *>(&a), sizeof a), 0);
    EXPECT_EQ(listen(fd_, 8), 0);
    socklen_t len = sizeof a;
    getsockname(fd_, reinterpret_cast<sockaddr *>(&a), &len);
    port = ntohs(a.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~FakeOwner() { Join(); }
  void Join() {
    stop_ = true;
    if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);
    if (thread_.joinable()) thread_.join();
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  uint16_t port = 0;
  std::atomic<int> reads{0};           // READs received
  std::atomic<int> answered{0};        // READs answered (ERROR included)
  std::atomic<size_t> max_waiting{0};  // the most READs waiting when one was answered
  std::string failure;

 private:
  void Serve() {
    while (!stop_) {
      const int cfd = accept(fd_, nullptr, nullptr);
      if (cfd < 0) return;
      datadist::Conn c(cfd, "fake");
      try {
        if (!Connection(c)) return;
      } catch (const datadist::Error &) {  // the reader closed it (a timeout, BYE's end): next one
      }
    }
  }
  // One connection; false when the owner is to die.
  bool Connection(datadist::Conn &c) {
    std::vector<uint8_t> payload;
    w::Header h = c.RecvFrame(payload, After(5));
    w::Hello welcome;
    welcome.cluster_id = kFakeOwner;
    c.SendFrame(w::EncodeHello(w::kWelcome, welcome, h.request_id), After(5));
    std::deque<std::pair<uint32_t, w::Request>> waiting;
    const auto take = [&](const w::Header &fh) {
      if (fh.type == w::kBye) {
        c.SendFrame(w::EncodeEmpty(w::kOk, fh.request_id), After(5));
        return false;
      }
      if (fh.type != w::kRead) {
        failure = std::string("unexpected ") + w::TypeName(fh.type);
        return false;
      }
      waiting.emplace_back(fh.request_id, w::DecodeRequest(fh.type, payload));
      ++reads;
      return true;
    };
    for (;;) {
      if (waiting.empty() && !take(c.RecvFrame(payload, After(30)))) return true;
      while (c.Buffered() > 0 || c.WaitReadable(static_cast<int>(o_.gather_s * 1000)))
        if (!take(c.RecvFrame(payload, After(5)))) return true;
      max_waiting = std::max<size_t>(max_waiting, waiting.size());
      const int n = answered;
      if (n == o_.die_after) {
        c.Close();
        shutdown(fd_, SHUT_RDWR);  // the listener too: a reconnect is refused
        return false;
      }
      if (n == o_.stall_after) {
        while (!stop_ && !c.WaitReadable(50)) {
        }
        return true;  // the reader closed it (its pull timed out)
      }
      if (n == o_.hold_at) std::this_thread::sleep_for(std::chrono::duration<double>(o_.hold_s));
      const auto [rid, q] = waiting.front();
      waiting.pop_front();
      if (n == o_.error_at) {
        w::ErrorMsg e;
        e.code = LLM_KV_CACHE_NOT_EXIST;
        e.message = "no such cache (fake)";
        c.SendFrame(w::EncodeError(e, rid), After(5));
      } else {
        std::vector<uint8_t> data;
        for (size_t t = 0; t < q.tensors.size(); ++t)
          for (size_t i = 0; i < q.offsets.size(); ++i)
            for (uint64_t b = 0; b < q.lengths[i]; ++b) data.push_back(At(q.offsets[i] + b));
        std::vector<uint8_t> out = w::EncodeU64(w::kReadData, data.size(), rid);
        out.insert(out.end(), data.begin(), data.end());
        c.SendAll(out.data(), out.size(), After(5));
      }
      ++answered;
    }
  }
  Options o_;
  int fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

/// A reader session on TCP (same_host off) linked to the fake owner.
std::unique_ptr<datadist::Session> Reader(uint16_t port, uint64_t owner = kFakeOwner) {
  auto s = std::make_unique<datadist::Session>(kReader, 1, 4);
  datadist::EngineOptions o;
  o.same_host = false;
  s->engine().Open(o);
  auto got = s->LinkMany({{owner, "127.0.0.1", port}}, After(5), false);
  EXPECT_EQ(got[0].code, LLM_SUCCESS) << got[0].why;
  return s;
}

/// `n` pulls of `bytes` each (pull k from offset k * bytes), issued in a row, each with its
/// own buffer; `timeout_s` each.
struct Issued {
  Issued(datadist::Session &s, size_t n, uint64_t bytes, double timeout_s = 5, uint64_t cluster = kFakeOwner,
         int64_t bad_cache_at = -1)
      : bytes(bytes), dst(n, std::vector<uint8_t>(bytes, 0)) {
    for (size_t k = 0; k < n; ++k) {
      w::Request q = Span(k * bytes, bytes, static_cast<int64_t>(k) == bad_cache_at ? 77 : 1);
      auto call = datadist::Call::Make(false, cluster, q, {{dst[k].data(), bytes}});
      tasks.push_back(s.Submit(call, After(timeout_s), datadist::Clock::now()));
    }
  }
  bool Right(size_t k) const {
    for (uint64_t b = 0; b < bytes; ++b)
      if (dst[k][b] != At(k * bytes + b)) return false;
    return true;
  }
  /// Every task ended by `s` seconds from now.
  bool AllEnd(double s) {
    for (auto &t : tasks)
      if (!t->Wait(After(s))) return false;
    return true;
  }
  uint64_t bytes;
  std::vector<std::vector<uint8_t>> dst;
  std::vector<std::shared_ptr<datadist::Task>> tasks;
};

// The core of it: pulls issued in a row on one link are in flight together (the owner has
// the next READ while it answers one), never more than the window, and each lands its bytes.
TEST(PipelinedRead, IssuedPullsOfOneLinkAreInFlightTogether) {
  FakeOwner owner({});
  auto reader = Reader(owner.port);
  Issued pulls(*reader, 40, 96 << 10);
  ASSERT_TRUE(pulls.AllEnd(10));
  for (size_t k = 0; k < pulls.tasks.size(); ++k) {
    EXPECT_EQ(pulls.tasks[k]->code(), LLM_SUCCESS) << k << ": " << pulls.tasks[k]->message();
    EXPECT_TRUE(pulls.Right(k)) << k;
  }
  EXPECT_GE(owner.max_waiting, 4u) << "the READs went one round trip after another";
  EXPECT_LE(owner.max_waiting, datadist::Link::kPipeCount);
  EXPECT_EQ(owner.reads, 40);
  reader->Close(0);
  owner.Join();
  EXPECT_EQ(owner.failure, "");
}

// A pull's task ends when its own bytes are in, not when the pulls in flight with it end.
TEST(PipelinedRead, EachPullEndsWhenItsOwnBytesAreIn) {
  FakeOwner::Options o;
  o.hold_at = 4;
  o.hold_s = 0.6;
  FakeOwner owner(o);
  auto reader = Reader(owner.port);
  Issued pulls(*reader, 8, 64 << 10);
  ASSERT_TRUE(pulls.tasks[3]->Wait(After(0.5)));
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_TRUE(pulls.tasks[k]->Done()) << k;
    EXPECT_EQ(pulls.tasks[k]->code(), LLM_SUCCESS) << k;
    EXPECT_TRUE(pulls.Right(k)) << k;
  }
  EXPECT_FALSE(pulls.tasks[4]->Done()) << "held by the owner: it cannot have ended";
  ASSERT_TRUE(pulls.AllEnd(5));
  for (size_t k = 4; k < 8; ++k) EXPECT_TRUE(pulls.Right(k)) << k;
  EXPECT_GE(owner.max_waiting, 2u) << "the READs went one round trip after another";
  reader->Close(0);
}

// An ERROR answer fails its own pull only: the READs in flight behind it are answered after
// it on the same connection, their bytes right.
TEST(PipelinedRead, AnErrorFailsOnlyItsPull) {
  FakeOwner::Options o;
  o.error_at = 3;
  FakeOwner owner(o);
  auto reader = Reader(owner.port);
  Issued pulls(*reader, 10, 64 << 10);
  ASSERT_TRUE(pulls.AllEnd(10));
  for (size_t k = 0; k < 10; ++k) {
    if (k == 3) {
      EXPECT_EQ(pulls.tasks[k]->code(), LLM_KV_CACHE_NOT_EXIST) << pulls.tasks[k]->message();
      continue;
    }
    EXPECT_EQ(pulls.tasks[k]->code(), LLM_SUCCESS) << k << ": " << pulls.tasks[k]->message();
    EXPECT_TRUE(pulls.Right(k)) << k;
  }
  EXPECT_GE(owner.max_waiting, 4u) << "the READs went one round trip after another";
  reader->Close(0);
}

// An owner that dies mid-batch: the pulls it answered succeed, every other one fails
// LLM_LINK_FAILED (those in flight on the dead connection, and those sent after: the
// reconnect is refused), and none hangs.
TEST(PipelinedRead, APeerThatDiesMidBatchFailsTheRestAndNoneHangs) {
  FakeOwner::Options o;
  o.die_after = 2;
  FakeOwner owner(o);
  auto reader = Reader(owner.port);
  const auto t0 = std::chrono::steady_clock::now();
  Issued pulls(*reader, 8, 64 << 10, 10);
  ASSERT_TRUE(pulls.AllEnd(5)) << "a pull hung";
  EXPECT_LT(ddtest::Seconds(t0), 3.0);
  for (size_t k = 0; k < 8; ++k) {
    if (k < 2) {
      EXPECT_EQ(pulls.tasks[k]->code(), LLM_SUCCESS) << k << ": " << pulls.tasks[k]->message();
      EXPECT_TRUE(pulls.Right(k)) << k;
    } else {
      EXPECT_EQ(pulls.tasks[k]->code(), LLM_LINK_FAILED) << k << ": " << pulls.tasks[k]->message();
    }
  }
  EXPECT_GE(owner.max_waiting, 2u) << "the READs went one round trip after another";
  reader->Close(0);
}

// An owner that stops answering: each pull ends by its own deadline with LLM_TIMEOUT (those
// in flight behind the one that timed out too), none later.
TEST(PipelinedRead, AStalledOwnerTimesEachPullOutByItsDeadline) {
  FakeOwner::Options o;
  o.stall_after = 1;
  FakeOwner owner(o);
  auto reader = Reader(owner.port);
  const auto t0 = std::chrono::steady_clock::now();
  Issued pulls(*reader, 6, 64 << 10, 0.8);
  ASSERT_TRUE(pulls.AllEnd(3)) << "a pull hung";
  EXPECT_LT(ddtest::Seconds(t0), 1.6);
  EXPECT_EQ(pulls.tasks[0]->code(), LLM_SUCCESS) << pulls.tasks[0]->message();
  for (size_t k = 1; k < 6; ++k)
    EXPECT_EQ(pulls.tasks[k]->code(), LLM_TIMEOUT) << k << ": " << pulls.tasks[k]->message();
  EXPECT_GE(owner.max_waiting, 2u) << "the READs went one round trip after another";
  reader->Close(0);
}

// A pull due before the pulls issued ahead of it keeps its own deadline: it does not wait
// behind them (the owner holds one of theirs for a second).
TEST(PipelinedRead, APullDueSoonerThanThoseAheadKeepsItsDeadline) {
  FakeOwner::Options o;
  o.hold_at = 0;
  o.hold_s = 1.0;
  FakeOwner owner(o);
  auto reader = Reader(owner.port);
  Issued ahead(*reader, 3, 64 << 10, 5);
  std::vector<uint8_t> dst(64 << 10);
  const auto t0 = std::chrono::steady_clock::now();
  auto call = datadist::Call::Make(false, kFakeOwner, Span(0, dst.size()), {{dst.data(), dst.size()}});
  auto task = reader->Submit(call, After(0.3), datadist::Clock::now());
  ASSERT_TRUE(task->Wait(After(3)));
  EXPECT_LT(ddtest::Seconds(t0), 0.8) << "it waited for the pulls ahead";
  EXPECT_TRUE(task->code() == LLM_LINK_BUSY || task->code() == LLM_TIMEOUT) << task->message();
  ASSERT_TRUE(ahead.AllEnd(5));
  for (size_t k = 0; k < 3; ++k) EXPECT_EQ(ahead.tasks[k]->code(), LLM_SUCCESS) << ahead.tasks[k]->message();
  reader->Close(0);
}

// The owner's side (server.cc): READs that arrive together (here in one send, the way a
// pipelined reader's may land in one recv) are answered in order, each in full, and an ERROR
// for one leaves the stream at the next answer's start.
TEST(PipelinedRead, TheOwnerAnswersReadsSentTogetherInOrderAnErrorBetweenThem) {
  ddtest::HostCache owned(1, std::vector<int64_t>{1, 4 << 20});
  for (uint64_t i = 0; i < (4u << 20); ++i) owned.T(0)[i] = At(i);
  datadist::Registry registry;
  ASSERT_EQ(registry.Add(owned.desc, owned.addrs, {}), 1);
  datadist::Identity ident;
  ident.cluster_id = kRealOwner;
  ident.serve_local = false;
  auto pool = std::make_shared<datadist::IoPool>(2);
  datadist::Server server(&registry, &ident, nullptr, pool);
  server.Start("127.0.0.1", 0);
  auto c = datadist::Conn::Connect("127.0.0.1", server.port(), After(2));
  w::Hello hello;
  hello.cluster_id = kReader;
  c->SendFrame(w::EncodeHello(w::kHello, hello, 1), After(2));
  std::vector<uint8_t> payload;
  ASSERT_EQ(c->RecvFrame(payload, After(2)).type, w::kWelcome);
  // 1 MiB, a READ of a cache that does not exist, 1 MiB, 16 bytes: one send.
  const std::vector<w::Request> reqs = {Span(0, 1 << 20), Span(0, 64, 5), Span(1 << 20, 1 << 20), Span(100, 16)};
  std::vector<uint8_t> all;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const std::vector<uint8_t> f = w::EncodeRequest(w::kRead, reqs[i], static_cast<uint32_t>(2 + i));
    all.insert(all.end(), f.begin(), f.end());
  }
  c->SendAll(all.data(), all.size(), After(2));
  for (size_t i = 0; i < reqs.size(); ++i) {
    const w::Header h = c->RecvFrame(payload, After(5));
    EXPECT_EQ(h.request_id, 2 + i);
    if (i == 1) {
      ASSERT_EQ(h.type, w::kError);
      EXPECT_EQ(w::DecodeError(payload).code, static_cast<int64_t>(LLM_KV_CACHE_NOT_EXIST));
      continue;
    }
    ASSERT_EQ(h.type, w::kReadData);
    const uint64_t n = w::DecodeU64(payload);
    ASSERT_EQ(n, reqs[i].lengths[0]);
    std::vector<uint8_t> got(n);
    c->RecvAll(got.data(), n, After(5));
    for (uint64_t b = 0; b < n; ++b)
      if (got[b] != At(reqs[i].offsets[0] + b)) {
        ADD_FAILURE() << "READ " << i << " byte " << b;
        break;
      }
  }
  // And the connection is at a frame's start: a PING is answered.
  c->SendFrame(w::EncodeU64(w::kPing, 9, 9), After(2));
  const w::Header h = c->RecvFrame(payload, After(2));
  EXPECT_EQ(h.type, w::kPong);
  EXPECT_EQ(h.request_id, 9u);
  c->Close();
  server.Stop();
}

// End to end on the real owner over TCP: 32 layer-sized pulls issued in a row, one of them
// for a cache the owner does not have, against a session that serves them; then 4 of 2 MiB.
TEST(PipelinedRead, ThePullsOfARealOwnerLandAndOneRefusalFailsAlone) {
  ddtest::HostCache owned(1, std::vector<int64_t>{1, 8 << 20});
  for (uint64_t i = 0; i < (8u << 20); ++i) owned.T(0)[i] = At(i);
  auto owner = std::make_unique<datadist::Session>(kRealOwner, 0, 2);
  datadist::EngineOptions o;
  o.same_host = false;
  owner->engine().Open(o);
  owner->engine().Listen("127.0.0.1", 0);
  const int64_t id = owner->engine().registry().Add(owned.desc, owned.addrs, {});
  ASSERT_EQ(id, 1);
  auto reader = Reader(owner->engine().port(), kRealOwner);
  ASSERT_TRUE(reader->engine().FindLink(kRealOwner)->Streams());
  Issued pulls(*reader, 32, 256 << 10, 10, kRealOwner, 17);
  ASSERT_TRUE(pulls.AllEnd(10));
  for (size_t k = 0; k < 32; ++k) {
    if (k == 17) {
      EXPECT_EQ(pulls.tasks[k]->code(), LLM_KV_CACHE_NOT_EXIST) << pulls.tasks[k]->message();
      continue;
    }
    EXPECT_EQ(pulls.tasks[k]->code(), LLM_SUCCESS) << k << ": " << pulls.tasks[k]->message();
    EXPECT_TRUE(pulls.Right(k)) << k;
  }
  // Answers over Link::kPipePart: the one alone in flight is read a part at a time (the
  // window filled between parts), the rest whole; every byte lands where it belongs.
  Issued large(*reader, 4, 2 << 20, 10, kRealOwner);
  ASSERT_TRUE(large.AllEnd(10));
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_EQ(large.tasks[k]->code(), LLM_SUCCESS) << k << ": " << large.tasks[k]->message();
    EXPECT_TRUE(large.Right(k)) << k;
  }
  // One alone of 2 MiB in 64 spans (every other 32 KiB of the owner's tensor), each into its
  // own local span: its parts cut across the spans.
  constexpr uint64_t kSpan = 32 << 10;
  w::Request q = Span(0, kSpan);
  std::vector<uint8_t> dst(64 * kSpan, 0);
  std::vector<iovec> iov;
  q.offsets.clear();
  q.lengths.clear();
  for (uint64_t i = 0; i < 64; ++i) {
    q.offsets.push_back(2 * i * kSpan);
    q.lengths.push_back(kSpan);
    iov.push_back({dst.data() + i * kSpan, kSpan});
  }
  auto spans = reader->Submit(datadist::Call::Make(false, kRealOwner, q, iov), After(10), datadist::Clock::now());
  ASSERT_TRUE(spans->Wait(After(10)));
  EXPECT_EQ(spans->code(), LLM_SUCCESS) << spans->message();
  for (uint64_t i = 0; i < 64 * kSpan; ++i)
    if (dst[i] != At(2 * (i / kSpan) * kSpan + i % kSpan)) {
      ADD_FAILURE() << "byte " << i;
      break;
    }
  reader->Close(0);
  owner->Close(0);
}

}  // namespace

// The eager WRITE (docs/protocol.md, "Push"): a push of at most wire::kEagerMax bytes in one
// round trip, the bytes right behind the request, to an owner whose WELCOME set
// FEATURE_EAGER_WRITE. The owner's side (server.cc: accepted, refused and drained, malformed,
// stalled) is driven here by hand over raw connections; the client's side (link.cc: the form
// only to an owner with the bit, two steps above the bound) against fake owners that speak the
// wire by hand. Every test fails on the code before (an owner that refused any WRITE flag as
// malformed and set no bit; a link that always waited for the go-ahead).
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "errors.h"
#include "iopool.h"
#include "link.h"
#include "net.h"
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

/// A WRITE (or READ) of `length` bytes of tensor 0 of cache `cache`, from `offset` of slot 0.
w::Request Span(uint64_t length, uint64_t offset = 0, uint64_t cache = 1, uint32_t flags = 0) {
  w::Request q;
  q.kind = w::kCacheId;
  q.a = cache;
  q.b = 0;
  q.flags = flags;
  q.tensors = {0};
  q.offsets = {offset};
  q.lengths = {length};
  return q;
}

std::vector<uint8_t> Bytes(size_t n, uint8_t seed) {
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(seed + i * 7);
  return out;
}

/// The frame of an eager WRITE, then its bytes: what an honest client sends in one go.
std::vector<uint8_t> EagerFrame(const w::Request &q, const std::vector<uint8_t> &data, uint32_t rid = 2) {
  std::vector<uint8_t> out = w::EncodeRequest(w::kWrite, q, rid);
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

/// The next frame, or the connection's end: "EOF" when the owner closed it.
std::string NextType(datadist::Conn &c, std::vector<uint8_t> &payload, uint32_t *rid = nullptr, double s = 3) {
  try {
    const w::Header h = c.RecvFrame(payload, After(s));
    if (rid) *rid = h.request_id;
    return w::TypeName(h.type);
  } catch (const datadist::Error &e) {
    return e.code() == LLM_TIMEOUT ? "TIMEOUT" : "EOF";
  }
}

/// An owner of one host cache (2 slots of 4 MiB: eager pushes of up to the bound fit one
/// slot), its listener on a pool of two threads.
class EagerWrite : public ::testing::Test {
 protected:
  void SetUp() override {
    owned = std::make_unique<HostCache>(1, std::vector<int64_t>{2, 4 << 20});
    ASSERT_EQ(registry.Add(owned->desc, owned->addrs, {}), 1);
    ident.cluster_id = kOwner;
    ident.serve_local = false;
    server = std::make_unique<datadist::Server>(&registry, &ident, nullptr, pool);
    server->Start("127.0.0.1", 0);
  }
  void TearDown() override {
    datadist::SetWriteTimeout(0);
    if (server) server->Stop();
  }
  /// A TCP connection that completed its HELLO; `features`: its WELCOME's.
  std::unique_ptr<datadist::Conn> Linked(uint64_t cluster, uint32_t *features = nullptr) {
    auto c = datadist::Conn::Connect("127.0.0.1", server->port(), After(2));
    w::Hello hello;
    hello.cluster_id = cluster;
    c->SendFrame(w::EncodeHello(w::kHello, hello, 1), After(2));
    std::vector<uint8_t> payload;
    EXPECT_EQ(c->RecvFrame(payload, After(2)).type, w::kWelcome);
    if (features) *features = w::DecodeHello(payload).features;
    return c;
  }
  /// PING answered by PONG with its request id on `c`: the connection is served, at a frame's start.
  void ServedOn(datadist::Conn &c, uint32_t rid) {
    c.SendFrame(w::EncodeU64(w::kPing, 77, rid), After(2));
    std::vector<uint8_t> payload;
    uint32_t got = 0;
    ASSERT_EQ(NextType(c, payload, &got), "PONG");
    EXPECT_EQ(got, rid);
    EXPECT_EQ(w::DecodeU64(payload), 77u);
  }
  /// An honest link (its own cluster id) pulls 64 bytes: how long it took to link and pull.
  double HonestPull(uint64_t cluster) {
    const auto t0 = std::chrono::steady_clock::now();
    w::Hello hello;
    hello.cluster_id = cluster;
    datadist::Link link(kOwner, "127.0.0.1", server->port(), hello, "", nullptr, false);
    uint8_t got[64] = {};
    try {
      link.Open(After(3));
      link.Read(Span(64, 4 << 20), {{got, 64}}, After(3));
    } catch (const datadist::Error &e) {
      ADD_FAILURE() << "the honest link failed: " << e.what();
      return 99;
    }
    EXPECT_EQ(std::memcmp(got, owned->T(0) + (4 << 20), 64), 0);
    link.Close(After(1), true);
    return ddtest::Seconds(t0);
  }

  std::shared_ptr<datadist::IoPool> pool = std::make_shared<datadist::IoPool>(2);
  std::unique_ptr<HostCache> owned;
  datadist::Registry registry;
  datadist::Identity ident;
  std::unique_ptr<datadist::Server> server;
};

// The codec: EAGER is WRITE's one flag; an eager WRITE names at most kEagerMax bytes (a total
// that overflows 64 bits included), and the encoder refuses to say what the decoder refuses.
TEST(EagerWriteCodec, AnEagerWriteNamesAtMostTheBound) {
  auto payload = [](const w::Request &q) {
    std::vector<uint8_t> f = w::EncodeRequest(w::kWrite, q, 1);
    return std::vector<uint8_t>(f.begin() + w::kHeaderSize, f.end());
  };
  w::Request q = Span(w::kEagerMax, 0, 1, w::kFlagEager);
  EXPECT_EQ(w::DecodeRequest(w::kWrite, payload(q)).flags, w::kFlagEager);
  EXPECT_EQ(w::SpanBytes(q), w::kEagerMax);
  q.lengths = {w::kEagerMax + 1};
  EXPECT_THROW(w::EncodeRequest(w::kWrite, q, 1), datadist::Error);
  q.tensors = {0, 1};
  q.offsets = {0, 0};
  q.lengths = {UINT64_MAX, 2};  // the sum wraps to 1
  EXPECT_EQ(w::SpanBytes(q), UINT64_MAX);
  EXPECT_THROW(w::EncodeRequest(w::kWrite, q, 1), datadist::Error);
  q.lengths = {uint64_t{1} << 63, 0};  // the product wraps to 0
  EXPECT_EQ(w::SpanBytes(q), UINT64_MAX);
  q.tensors.clear();  // no tensors: no bytes, whatever the lengths
  EXPECT_EQ(w::SpanBytes(q), 0u);
  EXPECT_NO_THROW(w::EncodeRequest(w::kWrite, q, 1));
  w::Request nixl = Span(64, 0, 1, w::kFlagEager);
  EXPECT_THROW(w::EncodeRequest(w::kNixlWrite, nixl, 1), datadist::Error);
  EXPECT_THROW(w::EncodeRequest(w::kRead, nixl, 1), datadist::Error);
  nixl.flags = w::kFlagEager | w::kFlagChecksum;
  EXPECT_THROW(w::EncodeRequest(w::kWrite, nixl, 1), datadist::Error);
}

TEST_F(EagerWrite, TheOwnerSaysItServesTheEagerForm) {
  uint32_t features = 0;
  auto c = Linked(10, &features);
  EXPECT_TRUE(features & w::kFeatureEagerWrite);
}

// Accepted: the bytes land and one OK answers (no go-ahead before it: the next frame is the
// PING's answer).
TEST_F(EagerWrite, AnAcceptedEagerWriteLandsWithOneAnswer) {
  auto c = Linked(11);
  for (const size_t n : {size_t{1}, size_t{16} << 10, size_t{w::kEagerMax}}) {
    const std::vector<uint8_t> data = Bytes(n, static_cast<uint8_t>(n));
    c->SendFrame(EagerFrame(Span(n, 0, 1, w::kFlagEager), data), After(5));
    std::vector<uint8_t> payload;
    uint32_t rid = 0;
    ASSERT_EQ(NextType(*c, payload, &rid), "OK") << n;
    EXPECT_EQ(rid, 2u);
    EXPECT_EQ(std::memcmp(owned->T(0), data.data(), n), 0) << n;
    ServedOn(*c, 3);
  }
}

// Refused (a cache it does not hold, a span past the tensor): exactly the request's bytes are
// drained (3 MiB: more than the socket holds, so across the connection's parks), then ERROR,
// and the next request on the same connection is served.
TEST_F(EagerWrite, ARefusedEagerWriteIsDrainedAndTheConnectionGoesOn) {
  auto c = Linked(12);
  owned->Fill(3);
  const std::vector<uint8_t> before(owned->T(0), owned->T(0) + owned->bytes);
  const size_t n = 3 << 20;
  const std::vector<uint8_t> data = Bytes(n, 9);
  struct Case {
    w::Request q;
    Status code;
  };
  const Case cases[] = {
      {Span(n, 0, 99, w::kFlagEager), LLM_KV_CACHE_NOT_EXIST},             // no such cache
      {Span(n, (8u << 20) - n + 1, 1, w::kFlagEager), LLM_PARAM_INVALID},  // past the tensor
      {Span(0, 0, 1, w::kFlagEager), LLM_PARAM_INVALID},                   // a span of 0 bytes
  };
  uint32_t rid = 2;
  for (const Case &k : cases) {
    const std::vector<uint8_t> sent =
        EagerFrame(k.q, std::vector<uint8_t>(data.begin(), data.begin() + k.q.lengths[0]), rid);
    c->SendFrame(sent, After(5));  // the owner drains while we send
    std::vector<uint8_t> payload;
    uint32_t got = 0;
    ASSERT_EQ(NextType(*c, payload, &got), "ERROR");
    EXPECT_EQ(got, rid);
    EXPECT_EQ(w::DecodeError(payload).code, static_cast<int64_t>(k.code)) << w::DecodeError(payload).message;
    ServedOn(*c, rid + 1);
    rid += 2;
  }
  EXPECT_EQ(std::memcmp(owned->T(0), before.data(), before.size()), 0);  // nothing landed
  // and a push that is allowed lands on the same connection
  c->SendFrame(EagerFrame(Span(64, 0, 1, w::kFlagEager), Bytes(64, 1), rid), After(2));
  std::vector<uint8_t> payload;
  ASSERT_EQ(NextType(*c, payload), "OK");
  EXPECT_EQ(std::memcmp(owned->T(0), Bytes(64, 1).data(), 64), 0);
}

// More bytes than the request's total: the surplus is read as the next frame's header (bad
// magic): a protocol violation, ERROR (request id 0), then closed. Fewer: the owner takes the
// next frame as the rest of the data and waits for more (a stalled writer; below).
TEST_F(EagerWrite, ATotalThatDisagreesWithTheBytesSentIsAProtocolViolation) {
  for (const bool refused : {false, true}) {
    auto c = Linked(13);
    std::vector<uint8_t> sent = EagerFrame(Span(64, 0, refused ? 99 : 1, w::kFlagEager), Bytes(64, 2));
    const std::vector<uint8_t> surplus(16, 'X');
    sent.insert(sent.end(), surplus.begin(), surplus.end());
    c->SendFrame(sent, After(2));
    std::vector<uint8_t> payload;
    uint32_t rid = 9;
    ASSERT_EQ(NextType(*c, payload, &rid), refused ? "ERROR" : "OK");  // the WRITE's own answer
    EXPECT_EQ(rid, 2u);
    ASSERT_EQ(NextType(*c, payload, &rid), "ERROR");  // the surplus
    EXPECT_EQ(rid, 0u);
    EXPECT_NE(w::DecodeError(payload).message.find("magic"), std::string::npos) << w::DecodeError(payload).message;
    EXPECT_EQ(NextType(*c, payload), "EOF");
  }
}

// An eager WRITE naming more than the bound, or one whose spans cannot be decoded: no known
// count of bytes to skip, so ERROR and the connection closed (before any byte is drained).
TEST_F(EagerWrite, AnEagerWriteOverTheBoundOrUndecodableIsRefusedAndClosed) {
  {
    auto c = Linked(14);
    // EncodeRequest refuses to say it: the flag set by hand in a plain WRITE's frame.
    std::vector<uint8_t> frame = w::EncodeRequest(w::kWrite, Span(w::kEagerMax + 1), 2);
    frame[w::kHeaderSize + 25 + 16] = static_cast<uint8_t>(w::kFlagEager);  // key, unit_bytes, layout, flags
    ASSERT_THROW(w::DecodeRequest(w::kWrite, std::vector<uint8_t>(frame.begin() + w::kHeaderSize, frame.end())),
                 datadist::Error);
    c->SendFrame(frame, After(2));
    std::vector<uint8_t> payload;
    ASSERT_EQ(NextType(*c, payload), "ERROR");
    EXPECT_NE(w::DecodeError(payload).message.find("eager"), std::string::npos) << w::DecodeError(payload).message;
    EXPECT_EQ(NextType(*c, payload), "EOF");
  }
  {
    auto c = Linked(15);
    std::vector<uint8_t> frame = w::EncodeRequest(w::kWrite, Span(64, 0, 1, w::kFlagEager), 2);
    frame[w::kHeaderSize + 25 + 16 + 4] = 0xFF;  // n_tensors beyond the payload
    c->SendFrame(frame, After(2));
    std::vector<uint8_t> payload;
    ASSERT_EQ(NextType(*c, payload), "ERROR");
    EXPECT_EQ(NextType(*c, payload), "EOF");
  }
}

// A writer that stalls mid-push, accepted or refused: parked (the other peers are served at
// once, on a pool of two threads against eight of them), and closed at the stalled writer's
// deadline (1 s here; 120 s by default).
TEST_F(EagerWrite, AStalledEagerWriterIsParkedAndClosedAtItsDeadline) {
  datadist::SetWriteTimeout(1.0);
  std::vector<std::unique_ptr<datadist::Conn>> stalled;
  for (int i = 0; i < 8; ++i) {
    stalled.push_back(Linked(100 + i));
    const bool refused = i % 2;
    const std::vector<uint8_t> sent = EagerFrame(Span(1 << 20, 0, refused ? 99 : 1, w::kFlagEager), Bytes(1 << 20, 4));
    stalled.back()->SendAll(sent.data(), sent.size() - 100, After(3));  // 100 bytes short
  }
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_LT(HonestPull(20), 0.5);
  EXPECT_LT(HonestPull(21), 0.5);
  for (auto &c : stalled) {
    std::vector<uint8_t> payload;
    EXPECT_EQ(NextType(*c, payload, nullptr, 5), "EOF");  // closed, without an answer
  }
  const double took = ddtest::Seconds(t0);
  EXPECT_GT(took, 0.5);
  EXPECT_LT(took, 3.0);
}

// ---- the client's side: fake owners speaking the wire by hand.

/// A fake owner on a thread: one connection, WELCOME with `features` (another host: TCP),
/// then WRITEs served as the protocol says for the flag each carries (a go-ahead OK only
/// without EAGER), each one's flags and bytes recorded, until BYE.
class FakeOwner {
 public:
  explicit FakeOwner(uint32_t features) : features_(features) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr *>(&a), sizeof a), 0);
    EXPECT_EQ(listen(fd_, 4), 0);
    socklen_t len = sizeof a;
    getsockname(fd_, reinterpret_cast<sockaddr *>(&a), &len);
    port = ntohs(a.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~FakeOwner() { Join(); }
  /// Waits for the connection's end (BYE, or a failure); then the records may be read.
  void Join() {
    if (!thread_.joinable()) return;
    shutdown(fd_, SHUT_RDWR);  // an accept still waiting (the link never came) returns
    thread_.join();
    close(fd_);
  }
  uint16_t port = 0;
  std::vector<uint32_t> flags;             // each WRITE's, in order
  std::vector<std::vector<uint8_t>> data;  // each WRITE's bytes
  std::string failure;                     // what went wrong on the owner's side

 private:
  void Serve() {
    const int cfd = accept(fd_, nullptr, nullptr);
    if (cfd < 0) return;
    datadist::Conn c(cfd, "fake");
    try {
      std::vector<uint8_t> payload;
      w::Header h = c.RecvFrame(payload, After(5));
      w::Hello welcome;
      welcome.cluster_id = kOwner;
      welcome.features = features_;
      c.SendFrame(w::EncodeHello(w::kWelcome, welcome, h.request_id), After(5));
      for (;;) {
        h = c.RecvFrame(payload, After(5));
        if (h.type == w::kBye) {
          c.SendFrame(w::EncodeEmpty(w::kOk, h.request_id), After(5));
          return;
        }
        if (h.type != w::kWrite) {
          failure = std::string("unexpected ") + w::TypeName(h.type);
          return;
        }
        const w::Request q = w::DecodeRequest(h.type, payload);
        flags.push_back(q.flags);
        if (!(q.flags & w::kFlagEager)) c.SendFrame(w::EncodeEmpty(w::kOk, h.request_id), After(5));  // go ahead
        data.emplace_back(w::SpanBytes(q));
        c.RecvAll(data.back().data(), data.back().size(), After(5));
        c.SendFrame(w::EncodeEmpty(w::kOk, h.request_id), After(5));
      }
    } catch (const datadist::Error &e) {
      failure = e.what();
    }
  }
  uint32_t features_;
  int fd_ = -1;
  std::thread thread_;
};

/// Pushes of `sizes` bytes through a link to `owner`, then BYE; checks what the owner got.
/// `asked`: flags the caller's request carries already (the link decides the form itself).
void PushAndCheck(FakeOwner &owner, const std::vector<size_t> &sizes, const std::vector<uint32_t> &want_flags,
                  uint32_t asked = 0) {
  w::Hello hello;
  hello.cluster_id = 50;
  {
    datadist::Link link(kOwner, "127.0.0.1", owner.port, hello, "", nullptr, false);
    link.Open(After(3));
    for (const size_t n : sizes) {
      std::vector<uint8_t> src = Bytes(n, static_cast<uint8_t>(n >> 10));
      try {
        w::Request req = Span(n);
        req.flags |= asked;
        link.Write(req, {{src.data(), n}}, After(5));
      } catch (const datadist::Error &e) {
        ADD_FAILURE() << "push of " << n << " bytes: " << e.what();
      }
    }
    link.Close(After(3), false);
  }
  owner.Join();
  EXPECT_EQ(owner.failure, "");
  EXPECT_EQ(owner.flags, want_flags);
  ASSERT_EQ(owner.data.size(), sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i)
    EXPECT_TRUE(owner.data[i] == Bytes(sizes[i], static_cast<uint8_t>(sizes[i] >> 10))) << sizes[i];
}

// An owner without the bit (an earlier revision refuses any WRITE flag as malformed) never
// receives the form: every push, however small, takes the two steps.
TEST(EagerWriteLink, AnOwnerWithoutTheBitNeverReceivesTheEagerForm) {
  FakeOwner owner(w::kFeatureToken);  // bits it may set, but not FEATURE_EAGER_WRITE
  PushAndCheck(owner, {1, 16 << 10, 1 << 20}, {0, 0, 0});
}

// A request that already carries EAGER (a raw plan's flags) is sent in the form the link
// chose: to an owner without the bit, or over the bound, in two steps without the flag (sent
// with it, the owner would wait for bytes while the link waits for a go-ahead).
TEST(EagerWriteLink, ACallersEagerFlagNeverReachesATwoStepWrite) {
  {
    FakeOwner owner(w::kFeatureToken);
    PushAndCheck(owner, {1, 16 << 10}, {0, 0}, w::kFlagEager);
  }
  FakeOwner owner(w::kFeatureEagerWrite);
  PushAndCheck(owner, {w::kEagerMax + 1, 64}, {0, w::kFlagEager}, w::kFlagEager);
}

// To an owner with the bit, every push up to the bound goes eagerly (the fake sends no
// go-ahead for those: a link that waited for one would time out); a larger one in two steps.
TEST(EagerWriteLink, PushesUpToTheBoundGoEagerlyToAnOwnerWithTheBit) {
  FakeOwner owner(w::kFeatureEagerWrite);
  PushAndCheck(owner, {1, 16 << 10, w::kEagerMax, w::kEagerMax + 1, 64},
               {w::kFlagEager, w::kFlagEager, w::kFlagEager, 0, w::kFlagEager});
}

}  // namespace

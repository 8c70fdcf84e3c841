// Trust, round 3 (issue 21 items 1-4 and "Also"; issue 22 item 9): the C++ owner, listener and
// leased reader against the hostile moves the review found. Each test says what happened before.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "errors.h"
#include "lease.h"
#include "local.h"
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
using ddtest::Index;

constexpr uint64_t kPrompt = 1, kDecoder = 2;

w::Hello RawHello(uint64_t cluster, uint32_t features = 0, std::string proof = {}) {
  w::Hello h;
  h.cluster_id = cluster;
  h.role = 2;
  h.pid = 1;
  h.features = features;
  h.proof = std::move(proof);
  return h;
}

/// Sends a HELLO on a fresh TCP connection; returns the connection and the answer.
struct Greeted {
  std::unique_ptr<datadist::Conn> conn;
  w::Header head;
  std::vector<uint8_t> payload;
};
Greeted Greet(uint16_t port, const w::Hello &h) {
  Greeted g;
  g.conn = datadist::Conn::Connect("127.0.0.1", port, After(2));
  g.conn->SendFrame(w::EncodeHello(w::kHello, h, 1), After(2));
  g.head = g.conn->RecvFrame(g.payload, After(2));
  return g;
}

std::string TokenOf(const Greeted &g) {
  w::Hello welcome = w::DecodeHello(g.payload);
  return w::SplitToken(welcome.proof, welcome.features).second;
}

/// A prompt that listens, a decoder that does not, the decoder linked to the prompt.
class Linked : public ::testing::Test {
 protected:
  void SetUp() override {
    port = ddtest::FreePort();
    ASSERT_EQ(prompt.Initialize(ddtest::Options(port)), LLM_SUCCESS);
    ASSERT_EQ(decoder.Initialize(ddtest::Options()), LLM_SUCCESS);
    ASSERT_EQ(src.Register(prompt), LLM_SUCCESS);
    ASSERT_EQ(dst.Register(decoder), LLM_SUCCESS);
    src.Fill(5);
    std::vector<Status> rets;
    ASSERT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 3000), LLM_SUCCESS);
  }
  uint16_t port = 0;
  HostCache src{2, {4, 16}};
  HostCache dst{2, {4, 16}};
  LlmDataDist prompt{kPrompt, LlmRole::kPrompt};
  LlmDataDist decoder{kDecoder, LlmRole::kDecoder};
};

// Item 1. Before: a raw HELLO(cluster 2, FEATURE_REVERSE) from any socket was adopted as the
// prompt's end of cluster 2's link, replacing the decoder's; the push went to the stranger.
TEST_F(Linked, AStrangerCannotTakeOverTheDecodersReverseChannel) {
  for (const std::string &proof : {std::string(), std::string(w::kLinkTokenBytes, '\x5a')}) {
    const uint32_t features = w::kFeatureReverse | (proof.empty() ? 0 : w::kFeatureToken);
    Greeted g = Greet(port, RawHello(kDecoder, features, proof));
    ASSERT_EQ(g.head.type, w::kError) << "a stranger's reverse channel was adopted";
    EXPECT_EQ(w::DecodeError(g.payload).code, static_cast<int64_t>(LLM_LINK_FAILED));
  }
  // a peer with its own control channel (cluster 5) cannot use its token for cluster 2
  Greeted control = Greet(port, RawHello(5));
  ASSERT_EQ(control.head.type, w::kWelcome);
  const std::string token = TokenOf(control);
  ASSERT_EQ(token.size(), w::kLinkTokenBytes);
  Greeted other = Greet(port, RawHello(kDecoder, w::kFeatureReverse | w::kFeatureToken, token));
  ASSERT_EQ(other.head.type, w::kError);
  // the push still reaches the real decoder
  ASSERT_EQ(prompt.PushKvCache(src.cache, Index(kDecoder, dst.cache.cache_id, 2), 1), LLM_SUCCESS);
  for (int t = 0; t < 2; ++t)
    for (int i = 0; i < 64; ++i) ASSERT_EQ(dst.T(t)[i], i >= 32 && i < 48 ? src.T(t)[16 + i - 32] : 0);
  // with its own cluster id the token is accepted
  Greeted mine = Greet(port, RawHello(5, w::kFeatureReverse | w::kFeatureToken, token));
  EXPECT_EQ(mine.head.type, w::kWelcome);
}

// Attack on round 3 (tests/security/test_attack_round3.py in Python). Before: any live control
// channel of cluster 2 made its token good for cluster 2's reverse channel, so a stranger opened
// its own control channel claiming cluster 2 (the id is only a claim), echoed the token it got,
// and replaced the decoder's reverse channel: the push went to the stranger.
TEST_F(Linked, ASecondControlChannelOfTheSameIdCannotTakeTheReverseChannel) {
  Greeted control = Greet(port, RawHello(kDecoder));
  ASSERT_EQ(control.head.type, w::kWelcome);
  Greeted rev = Greet(port, RawHello(kDecoder, w::kFeatureReverse | w::kFeatureToken, TokenOf(control)));
  ASSERT_EQ(rev.head.type, w::kError) << "a second control channel's token displaced the live reverse channel";
  EXPECT_EQ(w::DecodeError(rev.payload).code, static_cast<int64_t>(LLM_LINK_FAILED));
  ASSERT_EQ(prompt.PushKvCache(src.cache, Index(kDecoder, dst.cache.cache_id, 2), 1), LLM_SUCCESS);
  for (int t = 0; t < 2; ++t)
    for (int i = 0; i < 64; ++i) ASSERT_EQ(dst.T(t)[i], i >= 32 && i < 48 ? src.T(t)[16 + i - 32] : 0);
  // A reverse channel that does not answer a PING (its linker's channels died unseen, as a cut
  // wire leaves them; here a raw socket that never answers) is replaced by the relink's, even
  // while its control channel looks live; the live decoder above answered and kept its link.
  Greeted c1 = Greet(port, RawHello(7));
  Greeted r1 = Greet(port, RawHello(7, w::kFeatureReverse | w::kFeatureToken, TokenOf(c1)));
  ASSERT_EQ(r1.head.type, w::kWelcome);
  Greeted c2 = Greet(port, RawHello(7));
  Greeted r2 = Greet(port, RawHello(7, w::kFeatureReverse | w::kFeatureToken, TokenOf(c2)));
  EXPECT_EQ(r2.head.type, w::kWelcome);
}

// Issue 22 item 9. Before: C++ UnlinkLlmClusters dropped only the link it found first (ours),
// leaving the peer's reverse channel to us up, where Python drops both ends.
TEST_F(Linked, UnlinkDropsBothEndsOfATwoWayLink) {
  uint16_t dport = ddtest::FreePort();
  std::vector<Status> rets;
  ASSERT_EQ(decoder.UnlinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 3000), LLM_SUCCESS);
  ASSERT_EQ(decoder.SetRole(LlmRole::kDecoder, ddtest::Options(dport)), LLM_SUCCESS);
  ASSERT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 3000), LLM_SUCCESS);
  ASSERT_EQ(prompt.LinkLlmClusters({ddtest::Cluster(kDecoder, dport)}, rets, 3000), LLM_SUCCESS);
  // the prompt holds its own link to the decoder and the decoder's reverse channel to it
  ASSERT_EQ(prompt.UnlinkLlmClusters({ddtest::Cluster(kDecoder, dport)}, rets, 3000), LLM_SUCCESS);
  EXPECT_EQ(prompt.PushKvCache(src.cache, Index(kDecoder, dst.cache.cache_id, 2), 1), LLM_NOT_YET_LINK);
  EXPECT_EQ(prompt.SetRole(LlmRole::kPrompt, ddtest::Options(port)), LLM_SUCCESS);
}

// Issue 22 item 9. Before: a listener at its cap of reverse channels completed the client's
// handshake anyway (and closed the channel), so the client's link reported success.
TEST(Trust, AListenerThatWillNotAdoptAReverseChannelFailsTheClientsLink) {
  uint16_t port = ddtest::FreePort();
  LlmDataDist prompt(kPrompt, LlmRole::kPrompt), decoder(kDecoder, LlmRole::kDecoder);
  auto opts = ddtest::Options(port);
  opts["datadist.MaxConnections"] = "3";
  ASSERT_EQ(prompt.Initialize(opts), LLM_SUCCESS);
  ASSERT_EQ(decoder.Initialize(ddtest::Options()), LLM_SUCCESS);
  std::vector<Greeted> held;
  for (uint64_t cid : {10, 11, 12}) {  // reverse channels whose control channels then go
    Greeted control = Greet(port, RawHello(cid));
    ASSERT_EQ(control.head.type, w::kWelcome);
    Greeted rev = Greet(port, RawHello(cid, w::kFeatureReverse | w::kFeatureToken, TokenOf(control)));
    ASSERT_EQ(rev.head.type, w::kWelcome) << cid;
    control.conn->Close();
    held.push_back(std::move(rev));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(150));  // the closed ones are reaped
  std::vector<Status> rets;
  EXPECT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 3000), LLM_LINK_FAILED);
}

// Attack on round 3. Before: reverse channels were capped in all (MaxConnections) but not per
// address: one host opened a control channel and its reverse channel, closed the control
// channel, and went on with the next cluster id until the table was full and every other
// peer's link failed, whatever MaxConnectionsPerPeer said.
TEST(Trust, OneAddressCannotFillTheReverseChannelTable) {
  uint16_t port = ddtest::FreePort();
  LlmDataDist prompt(kPrompt, LlmRole::kPrompt);
  auto opts = ddtest::Options(port);
  opts["datadist.MaxConnections"] = "8";
  opts["datadist.MaxConnectionsPerPeer"] = "2";
  ASSERT_EQ(prompt.Initialize(opts), LLM_SUCCESS);
  std::vector<Greeted> held;
  std::vector<uint32_t> answers;
  std::string why;  // the refusals' words
  // Until the listener noticed the last control channel's close, it counts that channel
  // among this address's connections and refuses the next ones as connections (not as
  // reverse channels): those tries are made again.
  auto refused_as_connection = [](const Greeted &g) {
    return g.head.type == w::kError &&
           w::DecodeError(g.payload).message.find("too many connections to this owner") != std::string::npos;
  };
  for (uint64_t cid : {10, 11, 12, 13}) {
    Greeted control, rev;
    for (int i = 0; i < 100; ++i) {
      control = Greet(port, RawHello(cid));
      if (control.head.type == w::kWelcome) {
        rev = Greet(port, RawHello(cid, w::kFeatureReverse | w::kFeatureToken, TokenOf(control)));
        if (!refused_as_connection(rev)) break;
      }
      control.conn->Close();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ASSERT_EQ(control.head.type, w::kWelcome);
    answers.push_back(rev.head.type);
    if (rev.head.type == w::kError) why += w::DecodeError(rev.payload).message + "; ";
    control.conn->Close();
    held.push_back(std::move(rev));
  }
  EXPECT_EQ(answers, (std::vector<uint32_t>{w::kWelcome, w::kWelcome, w::kError, w::kError})) << why;
}

// Item 2. Before: 0-byte spans passed every check, and an address-keyed WRITE answered OK,
// LLM_PARAM_INVALID or LLM_KV_CACHE_NOT_EXIST depending on whether memory lay there.
TEST(Trust, ZeroLengthSpansAreRefusedAndAddressWritesGetOneAnswer) {
  datadist::Registry registry;
  HostCache c(2, {4, 64});
  const int64_t id = registry.Add(c.desc, c.addrs, {});
  auto answer = [&](uint64_t addr, uint64_t len) {
    w::Request q;
    q.kind = w::kAddress;
    q.tensors = {0};
    q.offsets = {addr};
    q.lengths = {len};
    try {
      registry.Open(q);
    } catch (const datadist::Error &e) {
      return std::to_string(e.code()) + " " + e.what();
    }
    return std::string("opened");
  };
  const std::string nowhere = answer(0x1000, 8);
  EXPECT_EQ(nowhere.rfind(std::to_string(LLM_PARAM_INVALID), 0), 0U) << nowhere;
  EXPECT_EQ(answer(c.addrs[0], 0), nowhere);        // inside a tensor, 0 bytes
  EXPECT_EQ(answer(0x1000, 0), nowhere);            // outside, 0 bytes
  EXPECT_EQ(answer(c.addrs[1] + 250, 8), nowhere);  // leaves the tensor
  EXPECT_EQ(answer(c.addrs[1] + 8, 8), "opened");
  w::Request by_id;
  by_id.kind = w::kCacheId;
  by_id.a = static_cast<uint64_t>(id);
  by_id.tensors = {0};
  by_id.offsets = {0};
  by_id.lengths = {0};
  try {
    registry.Open(by_id);
    FAIL() << "a 0-byte span by cache id was opened";
  } catch (const datadist::Error &e) {
    EXPECT_EQ(e.code(), LLM_PARAM_INVALID);
  }
}

// Item 3. Before: local peers were counted per pid, so a forked child got a fresh allowance.
TEST(Trust, TheLocalPerPeerCapCountsAUserSoAForkGainsNothing) {
  datadist::Registry registry;
  datadist::Identity ident;
  ident.cluster_id = 9;
  datadist::Server server(&registry, &ident);
  server.Start("127.0.0.1", 0, 256, 2);
  ASSERT_TRUE(server.serves_local());
  const std::string name = datadist::local::Name(static_cast<uint64_t>(getpid()), 9);
  std::vector<std::unique_ptr<datadist::Conn>> mine;
  for (int i = 0; i < 2; ++i) {
    mine.push_back(datadist::local::Connect(name, After(2)));
    mine.back()->SendFrame(w::EncodeHello(w::kHello, RawHello(10), 1), After(2));
    std::vector<uint8_t> p;
    ASSERT_EQ(mine.back()->RecvFrame(p, After(2)).type, w::kWelcome);
  }
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // only async-signal-safe-ish work: one connection, one answer
    int code = 2;
    try {
      auto c = datadist::local::Connect(name, After(2));
      c->SendFrame(w::EncodeHello(w::kHello, RawHello(11), 1), After(2));
      std::vector<uint8_t> p;
      code = c->RecvFrame(p, After(2)).type == w::kError ? 0 : 1;
    } catch (...) {
      code = 3;
    }
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the forked child was served past the per-peer cap";
  server.Stop();
}

// "Also". Before: the reader checked the owner's pidfd only after a leased copy, so a copy
// into a pid that had died (and could have been reused) was attempted.
TEST(Trust, ALeasedCopyChecksTheOwnerIsAliveBeforeCopying) {
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  std::string why;
  auto owner = datadist::lease::OwnerProc::Open(child, why);  // a zombie until reaped below
  ASSERT_TRUE(owner) << why;
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT), 0);  // exited, not reaped
  datadist::lease::Fence fence;                                                     // ours, standing for the owner's
  auto view = datadist::lease::FenceView::Open(getpid(), fence.fd(), fence.ino(), why);
  ASSERT_TRUE(view) << why;
  HostCache target(1, {4, 16});
  auto l = std::make_shared<datadist::lease::Leased>();
  l->msg.addrs = target.addrs;
  l->msg.tensor_bytes = 64;
  l->msg.units = 4;
  l->geo = {1, 64, 4, 16, 0};
  l->id = 1;
  l->write = true;
  l->owner = owner;
  l->fence = std::move(view);
  w::Request q;
  q.kind = w::kCacheId;
  q.a = 1;
  q.tensors = {0};
  q.offsets = {0};
  q.lengths = {16};
  std::vector<uint8_t> bytes(16, 0xAB);
  std::vector<iovec> local{{bytes.data(), bytes.size()}};
  EXPECT_EQ(datadist::lease::Copy(*l, q, local, why), datadist::lease::Outcome::kFailed);
  EXPECT_NE(why.find("before the copy"), std::string::npos) << why;
  EXPECT_TRUE(fence.Drained());  // the fence was left again
  waitpid(child, nullptr, 0);
}

}  // namespace

// Transfers between two LlmDataDist instances in this process, over TCP: every byte checked,
// every owner-side check, deadlines against stopped and dead peers, and the xLLM-style flow.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "errors.h"
#include "local.h"
#include "test_util.h"
#include "wire.h"

namespace {

using namespace llm_datadist;
using ddtest::Ext;
using ddtest::HostCache;
using ddtest::Index;

constexpr uint64_t kPrompt = 0;                                      // cluster id 0 is valid
constexpr uint64_t kDecoder = (uint64_t{0x7F000001} << 32) | 26001;  // xLLM-style (ipv4 << 32) | port

using ddtest::Seconds;

class Pair : public ::testing::Test {
 protected:
  void SetUp() override {
    port = ddtest::FreePort();
    ASSERT_EQ(prompt.Initialize(ddtest::Options(port)), LLM_SUCCESS);
    ASSERT_EQ(decoder.Initialize(ddtest::Options(0, "1000")), LLM_SUCCESS);
    ASSERT_EQ(src.Register(prompt), LLM_SUCCESS);
    ASSERT_EQ(dst.Register(decoder), LLM_SUCCESS);
    src.Fill(7);
    std::vector<Status> rets;
    ASSERT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 3000), LLM_SUCCESS);
  }
  uint16_t port = 0;
  // Memory outlives the instances using it (declared first, destroyed last).
  HostCache src{4, {4, 16}};  // 2 layers x (K, V); 4 slots/blocks of 16 bytes
  HostCache dst{4, {4, 16}};
  LlmDataDist prompt{kPrompt, LlmRole::kPrompt};
  LlmDataDist decoder{kDecoder, LlmRole::kDecoder};
};

TEST_F(Pair, PullKvCacheMovesOneSlot) {
  ASSERT_EQ(decoder.PullKvCache(Index(kPrompt, 1, 2), dst.cache, 1), LLM_SUCCESS);
  for (int t = 0; t < 4; ++t)
    for (int i = 0; i < 64; ++i) ASSERT_EQ(dst.T(t)[i], (i >= 16 && i < 32) ? src.T(t)[32 + i - 16] : 0) << t << i;
  // a prefix of the slot, layer 1 only
  std::memset(dst.T(2), 0, 64);
  std::memset(dst.T(3), 0, 64);
  ASSERT_EQ(decoder.PullKvCache(Index(kPrompt, 1, 3), dst.cache, 0, 5, Ext({1, 1}, {1, 1})), LLM_SUCCESS);
  for (int t = 2; t < 4; ++t)
    for (int i = 0; i < 64; ++i) ASSERT_EQ(dst.T(t)[i], i < 5 ? src.T(t)[48 + i] : 0);
  // "A Cache may carry only cache_id"
  Cache only_id{};
  only_id.cache_id = dst.cache.cache_id;
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1, 0), only_id, 3), LLM_SUCCESS);
  EXPECT_EQ(std::memcmp(dst.T(0) + 48, src.T(0), 16), 0);
}

TEST_F(Pair, PullKvBlocksWithLayerRanges) {
  ASSERT_EQ(decoder.PullKvBlocks(Index(kPrompt, 1), dst.cache, {3, 0, 1}, {0, 2, 3}), LLM_SUCCESS);
  for (int t = 0; t < 4; ++t) {
    EXPECT_EQ(std::memcmp(dst.T(t), src.T(t) + 48, 16), 0);
    EXPECT_EQ(std::memcmp(dst.T(t) + 32, src.T(t), 32), 0);  // 0,1 -> 2,3: one coalesced span
    for (int i = 16; i < 32; ++i) ASSERT_EQ(dst.T(t)[i], 0);
  }
  // remote layer 0 into local layer 1
  HostCache fresh(4, {4, 16});
  ASSERT_EQ(fresh.Register(decoder), LLM_SUCCESS);
  ASSERT_EQ(decoder.PullKvBlocks(Index(kPrompt, 1), fresh.cache, {2}, {1}, Ext({0, 0}, {1, 1})), LLM_SUCCESS);
  for (int t = 0; t < 4; ++t)
    for (int i = 0; i < 64; ++i)
      ASSERT_EQ(fresh.T(t)[i], (t >= 2 && i >= 16 && i < 32) ? src.T(t - 2)[32 + i - 16] : 0) << t << " " << i;
  // empty src_blocks: the remote slot split into blocks
  HostCache split(4, {4, 16});
  ASSERT_EQ(split.Register(decoder), LLM_SUCCESS);
  ASSERT_EQ(decoder.PullKvBlocks(Index(kPrompt, 1), split.cache, {}, {3, 1}), LLM_SUCCESS);
  EXPECT_EQ(std::memcmp(split.T(1) + 48, src.T(1), 16), 0);
  EXPECT_EQ(std::memcmp(split.T(1) + 16, src.T(1) + 16, 16), 0);
  // as CANN: a range on one side only of a pull means all tensors
  HostCache one_sided(4, {4, 16});
  ASSERT_EQ(one_sided.Register(decoder), LLM_SUCCESS);
  ASSERT_EQ(decoder.PullKvBlocks(Index(kPrompt, 1), one_sided.cache, {0}, {0}, Ext({1, 1}, {-1, -1})), LLM_SUCCESS);
  for (int t = 0; t < 4; ++t) EXPECT_EQ(std::memcmp(one_sided.T(t), src.T(t), 16), 0) << t;
}

TEST_F(Pair, OwnerAndLocalChecksGiveStatusCodes) {
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 9), dst.cache), LLM_KV_CACHE_NOT_EXIST);
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, -1), dst.cache),
            LLM_KV_CACHE_NOT_EXIST);  // as CANN: an id the peer does not have
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1, 4), dst.cache), LLM_PARAM_INVALID);  // remote slot
  {
    // no layer range: every tensor, and the source must have as many (CANN's GetSendTask);
    // with ranges, the first layer of a 4-tensor cache into a 2-tensor one is fine
    HostCache two(2, {4, 16});
    ASSERT_EQ(two.Register(decoder), LLM_SUCCESS);
    EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1, 1), two.cache), LLM_PARAM_INVALID);
    EXPECT_EQ(decoder.PullKvBlocks(Index(kPrompt, 1), two.cache, {1}, {1}), LLM_PARAM_INVALID);
    ASSERT_EQ(decoder.PullKvCache(Index(kPrompt, 1, 1), two.cache, 0, -1, Ext({1, 1}, {0, 0})), LLM_SUCCESS);
    EXPECT_EQ(std::memcmp(two.T(1), src.T(3) + 16, 16), 0);
    ASSERT_EQ(decoder.UnregisterKvCache(two.cache.cache_id), LLM_SUCCESS);
  }
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), dst.cache, 4), LLM_PARAM_INVALID);  // local slot
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), dst.cache, 0, 17), LLM_PARAM_INVALID);
  EXPECT_EQ(decoder.PullKvBlocks(Index(kPrompt, 1), dst.cache, {4}, {0}), LLM_PARAM_INVALID);  // remote block
  EXPECT_EQ(decoder.PullKvBlocks(Index(kPrompt, 1), dst.cache, {0}, {4}), LLM_PARAM_INVALID);  // local block
  EXPECT_EQ(decoder.PullKvBlocks(Index(kPrompt, 1), dst.cache, {0, 1}, {0}), LLM_PARAM_INVALID);
  EXPECT_EQ(decoder.PullKvBlocks(Index(kPrompt, 1), dst.cache, {}, {}), LLM_PARAM_INVALID);
  EXPECT_EQ(decoder.PullKvBlocks(Index(kPrompt, 1), dst.cache, {~0ULL}, {0}), LLM_PARAM_INVALID);
  // bad layer ranges
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), dst.cache, 0, -1, Ext({1, 0}, {1, 0})), LLM_PARAM_INVALID);
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), dst.cache, 0, -1, Ext({-2, 1}, {0, 1})), LLM_PARAM_INVALID);
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), dst.cache, 0, -1, Ext({0, 1}, {0, -2})), LLM_PARAM_INVALID);
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), dst.cache, 0, -1, Ext({0, 0}, {0, 1})), LLM_PARAM_INVALID);
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), dst.cache, 0, -1, Ext({0, 2}, {0, 2})), LLM_PARAM_INVALID);
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), dst.cache, 0, -1, Ext({2, 2}, {1, 1})),
            LLM_PARAM_INVALID);  // remote has 2 layers
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), dst.cache, 0, -1, Ext({0, 0}, {0, 0}, 0)), LLM_PARAM_INVALID);
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), dst.cache, 0, -1, Ext({1, 1}, {1, 1}, 3)), LLM_PARAM_INVALID);
  // another dtype on the owner's side
  HostCache wide(4, {4, 8}, DT_FLOAT16, 2);
  ASSERT_EQ(wide.Register(decoder), LLM_SUCCESS);
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), wide.cache), LLM_PARAM_INVALID);
  // more local tensors than the remote cache has
  HostCache more(6, {4, 16});
  ASSERT_EQ(more.Register(decoder), LLM_SUCCESS);
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), more.cache), LLM_PARAM_INVALID);
  // none of that broke the link, and nothing was written
  for (int t = 0; t < 4; ++t)
    for (int i = 0; i < 64; ++i) ASSERT_EQ(dst.T(t)[i], 0);
  ASSERT_EQ(decoder.PullKvCache(Index(kPrompt, 1), dst.cache), LLM_SUCCESS);
  EXPECT_EQ(std::memcmp(dst.T(3), src.T(3), 16), 0);
  // an unregistered remote cache is gone for peers
  ASSERT_EQ(prompt.UnregisterKvCache(1), LLM_SUCCESS);
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), dst.cache), LLM_KV_CACHE_NOT_EXIST);
}

TEST_F(Pair, PushesLandInTheOwnersCache) {
  // the prompt pushes to the decoder, which must listen (and be linked to) for that
  uint16_t dport = ddtest::FreePort();
  auto opts = ddtest::Options(dport);
  // CANN's SwitchRole: not while a link is up (ours, or a peer's to us)
  EXPECT_EQ(decoder.SetRole(LlmRole::kDecoder, opts), LLM_EXIST_LINK);
  EXPECT_EQ(prompt.SetRole(LlmRole::kPrompt, ddtest::Options(port)), LLM_EXIST_LINK);
  std::vector<Status> rets;
  ASSERT_EQ(decoder.UnlinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 5000), LLM_SUCCESS);
  ASSERT_EQ(decoder.SetRole(LlmRole::kDecoder, opts), LLM_SUCCESS);
  ASSERT_EQ(decoder.SetRole(LlmRole::kDecoder, opts), LLM_SUCCESS);  // listening there already
  ASSERT_EQ(prompt.LinkLlmClusters({ddtest::Cluster(kDecoder, dport)}, rets, 5000), LLM_SUCCESS);
  EXPECT_EQ(prompt.LinkLlmClusters({ddtest::Cluster(kDecoder, dport)}, rets), LLM_ALREADY_LINK);
  ASSERT_EQ(prompt.PushKvCache(src.cache, Index(kDecoder, 1, 3), 1), LLM_SUCCESS);
  for (int t = 0; t < 4; ++t)
    for (int i = 0; i < 64; ++i) ASSERT_EQ(dst.T(t)[i], i >= 48 ? src.T(t)[16 + i - 48] : 0);
  // layer by layer, blocks
  for (int32_t l = 0; l < 2; ++l)
    ASSERT_EQ(prompt.PushKvBlocks(src.cache, Index(kDecoder, 1), {0, 2}, {1, 2}, Ext({l, l}, {l, l})), LLM_SUCCESS);
  for (int t = 0; t < 4; ++t) {
    EXPECT_EQ(std::memcmp(dst.T(t) + 16, src.T(t), 16), 0);
    EXPECT_EQ(std::memcmp(dst.T(t) + 32, src.T(t) + 32, 16), 0);
  }
  // as CANN's layer-wise pushes: a source range needs a destination range (dst layer -1 is
  // out of range there), and a source of 3 tensors is not layers of 2
  EXPECT_EQ(prompt.PushKvCache(src.cache, Index(kDecoder, 1, 3), 1, -1, Ext({1, 1}, {-1, -1})), LLM_PARAM_INVALID);
  HostCache odd(3, {4, 16});
  ASSERT_EQ(odd.Register(prompt), LLM_SUCCESS);
  EXPECT_EQ(prompt.PushKvCache(odd.cache, Index(kDecoder, 1, 3)), LLM_PARAM_INVALID);
  EXPECT_EQ(prompt.PushKvBlocks(odd.cache, Index(kDecoder, 1), {0}, {1}), LLM_PARAM_INVALID);
  EXPECT_EQ(prompt.PushKvBlocks(odd.cache, Index(kDecoder, 1), {0}, {1}, Ext({-1, -1}, {-1, -1}, 1)), LLM_SUCCESS);
  EXPECT_EQ(prompt.PushKvBlocks(src.cache, Index(kDecoder, 1), {0}, {4}), LLM_PARAM_INVALID);
  EXPECT_EQ(prompt.PushKvBlocks(src.cache, Index(kDecoder, 8), {0}, {0}), LLM_KV_CACHE_NOT_EXIST);
  EXPECT_EQ(prompt.PushKvCache(src.cache, Index(kDecoder, 1, 4)), LLM_PARAM_INVALID);
  // SetRole without a listen address stops serving (once the decoder dropped its end of the
  // prompt's link): the prompt's next push finds nobody
  EXPECT_EQ(decoder.SetRole(LlmRole::kDecoder, {}), LLM_EXIST_LINK);
  ASSERT_EQ(decoder.UnlinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 1000, true), LLM_SUCCESS);
  ASSERT_EQ(decoder.SetRole(LlmRole::kPrompt, {}), LLM_SUCCESS);
  Status s = prompt.PushKvCache(src.cache, Index(kDecoder, 1, 0));
  EXPECT_TRUE(s == LLM_LINK_FAILED || s == LLM_TIMEOUT) << s;
  ASSERT_EQ(prompt.UnlinkLlmClusters({ddtest::Cluster(kDecoder, dport)}, rets, 1000, true), LLM_SUCCESS);
}

TEST_F(Pair, UnlinkThenPullIsNotLinked) {
  std::vector<Status> rets;
  ASSERT_EQ(decoder.UnlinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 5000), LLM_SUCCESS);
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), dst.cache), LLM_NOT_YET_LINK);
  ASSERT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 5000), LLM_SUCCESS);  // relink
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), dst.cache), LLM_SUCCESS);
}

TEST_F(Pair, AListenerSwitchesRoleOnceItsClientsAreGone) {
  // the decoder's link counts at the prompt (CANN: LLM_EXIST_LINK) until the decoder unlinks
  EXPECT_EQ(prompt.SetRole(LlmRole::kMix, ddtest::Options(port)), LLM_EXIST_LINK);
  std::vector<Status> rets;
  ASSERT_EQ(decoder.UnlinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 3000), LLM_SUCCESS);
  Status s = LLM_EXIST_LINK;
  for (int i = 0; i < 100 && s == LLM_EXIST_LINK; ++i) {  // its reverse channel closes at once; allow a moment
    s = prompt.SetRole(LlmRole::kMix, ddtest::Options(port));
    if (s == LLM_EXIST_LINK) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(s, LLM_SUCCESS);
  // and a client that just ends counts no more either
  ASSERT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 3000), LLM_SUCCESS);
  EXPECT_EQ(prompt.SetRole(LlmRole::kPrompt, ddtest::Options(port)), LLM_EXIST_LINK);
  decoder.Finalize();
  s = LLM_EXIST_LINK;
  for (int i = 0; i < 100 && s == LLM_EXIST_LINK; ++i) {
    s = prompt.SetRole(LlmRole::kPrompt, ddtest::Options(port));
    if (s == LLM_EXIST_LINK) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(s, LLM_SUCCESS);
}

TEST_F(Pair, UnlinkOfADeadPeerIsUnlinkFailedAndOurEndIsGone) {
  prompt.Finalize();
  std::vector<Status> rets;
  // as CANN's UnlinkCluster when it cannot reach the peer; our end is closed all the same
  EXPECT_EQ(decoder.UnlinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 1000), LLM_UNLINK_FAILED);
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), dst.cache), LLM_NOT_YET_LINK);
  HostCache src2(4, {4, 16});
  LlmDataDist again(kPrompt, LlmRole::kPrompt);
  ASSERT_EQ(again.Initialize(ddtest::Options(port)), LLM_SUCCESS);
  ASSERT_EQ(src2.Register(again), LLM_SUCCESS);
  ASSERT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 3000), LLM_SUCCESS);
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), dst.cache), LLM_SUCCESS);
  again.Finalize();
}

TEST_F(Pair, DeadPeerFailsFastAndARestartedOneIsReconnected) {
  prompt.Finalize();
  auto t0 = std::chrono::steady_clock::now();
  Status s = decoder.PullKvCache(Index(kPrompt, 1), dst.cache);
  EXPECT_TRUE(s == LLM_LINK_FAILED || s == LLM_TIMEOUT) << s;
  EXPECT_LT(Seconds(t0), 3.0);
  HostCache src2(4, {4, 16});
  LlmDataDist again(kPrompt, LlmRole::kPrompt);
  ASSERT_EQ(again.Initialize(ddtest::Options(port)), LLM_SUCCESS);
  ASSERT_EQ(src2.Register(again), LLM_SUCCESS);
  src2.Fill(9);
  ASSERT_EQ(decoder.PullKvCache(Index(kPrompt, 1, 1), dst.cache), LLM_SUCCESS);
  EXPECT_EQ(std::memcmp(dst.T(2), src2.T(2) + 16, 16), 0);
}

// A peer that says WELCOME and then nothing: a stopped process, as far as we can tell.
class SilentPeer {
 public:
  explicit SilentPeer(uint64_t cluster_id, bool welcome) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd_, reinterpret_cast<sockaddr *>(&a), sizeof(a));
    listen(fd_, 4);
    socklen_t len = sizeof(a);
    getsockname(fd_, reinterpret_cast<sockaddr *>(&a), &len);
    port = ntohs(a.sin_port);
    thread_ = std::thread([this, cluster_id, welcome] {
      int c = accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      uint8_t buf[256];
      ssize_t n = recv(c, buf, sizeof(buf), 0);
      hello_at = std::chrono::steady_clock::now().time_since_epoch().count();
      if (welcome && n >= 12) {
        datadist::wire::Hello w;
        w.cluster_id = cluster_id;
        uint32_t rid = buf[4] | buf[5] << 8 | buf[6] << 16 | static_cast<uint32_t>(buf[7]) << 24;
        auto frame = datadist::wire::EncodeHello(datadist::wire::kWelcome, w, rid);
        (void)send(c, frame.data(), frame.size(), MSG_NOSIGNAL);
      }
      while (!stop_) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      close(c);
    });
  }
  ~SilentPeer() {
    stop_ = true;
    shutdown(fd_, SHUT_RDWR);
    thread_.join();
    close(fd_);
  }
  uint16_t port = 0;
  std::atomic<int64_t> hello_at{0};  // when the HELLO arrived (steady clock ticks)

 private:
  int fd_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Issue 22 item 8: listen, link, pull, push and unlink over the IPv6 loopback ("[::1]:port" as
// the original's LLMUtils::ParseListenIpInfo takes it; IpInfo::ip a bare "::1").
TEST(Ipv6, LinkPullPushAndUnlinkOverTheLoopback) {
  const uint16_t port = ddtest::FreePort6();
  if (port == 0) GTEST_SKIP() << "no IPv6 loopback on this host";
  HostCache src{4, {4, 16}}, dst{4, {4, 16}};
  LlmDataDist prompt{kPrompt, LlmRole::kPrompt}, decoder{kDecoder, LlmRole::kDecoder};
  auto opts = ddtest::Options();
  opts[OPTION_LISTEN_IP_INFO] = ("[::1]:" + std::to_string(port)).c_str();
  ASSERT_EQ(prompt.Initialize(opts), LLM_SUCCESS);
  ASSERT_EQ(decoder.Initialize(ddtest::Options()), LLM_SUCCESS);
  ASSERT_EQ(src.Register(prompt), LLM_SUCCESS);
  ASSERT_EQ(dst.Register(decoder), LLM_SUCCESS);
  src.Fill(5);
  std::vector<Status> rets;
  ClusterInfo to_prompt = ddtest::Cluster(kPrompt, port, "0:0:0:0:0:0:0:1");
  to_prompt.local_ip_infos.push_back(to_prompt.remote_ip_infos[0]);
  ASSERT_EQ(decoder.LinkLlmClusters({to_prompt}, rets, 3000), LLM_SUCCESS);
  ASSERT_EQ(decoder.PullKvCache(Index(kPrompt, 1, 2), dst.cache, 1), LLM_SUCCESS);
  for (int t = 0; t < 4; ++t) ASSERT_EQ(std::memcmp(dst.T(t) + 16, src.T(t) + 32, 16), 0) << t;
  // a push over the same link lands in the prompt's slot 0
  dst.Fill(9);
  ASSERT_EQ(decoder.PushKvCache(dst.cache, Index(kPrompt, 1, 0), 3), LLM_SUCCESS);
  for (int t = 0; t < 4; ++t) ASSERT_EQ(std::memcmp(src.T(t), dst.T(t) + 48, 16), 0) << t;
  // unlink tells the prompt at [::1]; unlinked, its listener still answers there
  ClusterInfo by_ip = ddtest::Cluster(kPrompt, port, "::1");
  ASSERT_EQ(decoder.UnlinkLlmClusters({by_ip}, rets, 3000), LLM_SUCCESS);
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 1), dst.cache), LLM_NOT_YET_LINK);
  EXPECT_EQ(decoder.UnlinkLlmClusters({by_ip}, rets, 3000), LLM_SUCCESS);
  const uint16_t dead = ddtest::FreePort6();
  EXPECT_EQ(decoder.UnlinkLlmClusters({ddtest::Cluster(kPrompt, dead, "::1")}, rets, 1000), LLM_UNLINK_FAILED);
  EXPECT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(kPrompt, dead, "::1")}, rets, 1000), LLM_LINK_FAILED);
}

TEST(Deadlines, StoppedPeerGivesTimeoutWithinTheDeadline) {
  HostCache h(2, {4, 8});
  LlmDataDist dd(1, LlmRole::kDecoder);
  ASSERT_EQ(dd.Initialize(ddtest::Options(0, "300")), LLM_SUCCESS);
  ASSERT_EQ(h.Register(dd), LLM_SUCCESS);
  SilentPeer peer(2, true);
  std::vector<Status> rets;
  ASSERT_EQ(dd.LinkLlmClusters({ddtest::Cluster(2, peer.port)}, rets, 2000), LLM_SUCCESS);
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(dd.PullKvCache(Index(2, 1), h.cache), LLM_TIMEOUT);
  EXPECT_GE(Seconds(t0), 0.25);
  EXPECT_LT(Seconds(t0), 2.0);
  t0 = std::chrono::steady_clock::now();
  Status s = dd.PushKvBlocks(h.cache, Index(2, 1), {0}, {0});
  EXPECT_TRUE(s == LLM_TIMEOUT || s == LLM_LINK_FAILED) << s;
  EXPECT_LT(Seconds(t0), 2.0);
}

TEST(Deadlines, PeerThatNeverAnswersHelloFailsTheLink) {
  LlmDataDist dd(1, LlmRole::kDecoder);
  ASSERT_EQ(dd.Initialize(ddtest::Options()), LLM_SUCCESS);
  SilentPeer peer(2, false);
  std::vector<Status> rets;
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(dd.LinkLlmClusters({ddtest::Cluster(2, peer.port)}, rets, 300), LLM_LINK_FAILED);
  EXPECT_LT(Seconds(t0), 2.0);
  // a WELCOME from another cluster than asked for is no failure: CANN files the link under
  // the id the peer announces (LinkIds.ALinkIsFiledUnderTheIdThePeerReports)
  SilentPeer other(3, true);
  EXPECT_EQ(dd.LinkLlmClusters({ddtest::Cluster(2, other.port)}, rets, 1000), LLM_SUCCESS);
}

// Finalize (the engine's Close: every link closed by force) fails a pull in flight on a peer
// that went silent, and one waiting for that link, at once; before,
// they ran to their own deadlines (here 60 s) and Finalize waited for them.
TEST(Deadlines, FinalizeFailsTransfersInFlightAtOnce) {
  HostCache h(2, {4, 8});
  LlmDataDist dd(1, LlmRole::kDecoder);
  ASSERT_EQ(dd.Initialize(ddtest::Options(0, "60000")), LLM_SUCCESS);
  ASSERT_EQ(h.Register(dd), LLM_SUCCESS);
  SilentPeer peer(2, true);
  std::vector<Status> rets;
  ASSERT_EQ(dd.LinkLlmClusters({ddtest::Cluster(2, peer.port)}, rets, 2000), LLM_SUCCESS);
  std::atomic<Status> first{LLM_SUCCESS}, second{LLM_SUCCESS};
  std::thread a([&] { first = dd.PullKvCache(Index(2, 1), h.cache); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));               // a's READ is out, unanswered
  std::thread b([&] { second = dd.PullKvCache(Index(2, 1, 1), h.cache); });  // waits for the link
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  auto t0 = std::chrono::steady_clock::now();
  dd.Finalize();
  a.join();
  b.join();
  EXPECT_LT(Seconds(t0), 5.0);
  EXPECT_EQ(first.load(), LLM_LINK_FAILED);
  EXPECT_EQ(second.load(), LLM_LINK_FAILED);
}

TEST(Deadlines, ClustersLinkInParallelAndEachGetsItsCode) {
  uint16_t port = ddtest::FreePort();
  LlmDataDist good(3, LlmRole::kPrompt), dd(1, LlmRole::kDecoder);
  ASSERT_EQ(good.Initialize(ddtest::Options(port)), LLM_SUCCESS);
  ASSERT_EQ(dd.Initialize(ddtest::Options()), LLM_SUCCESS);
  SilentPeer silent_a(2, false), silent_b(4, false);
  std::vector<Status> rets;
  EXPECT_EQ(
      dd.LinkLlmClusters(
          {ddtest::Cluster(2, silent_a.port), ddtest::Cluster(3, port), ddtest::Cluster(4, silent_b.port)}, rets, 1500),
      LLM_LINK_FAILED);
  // In parallel: both silent peers got their HELLO at once, not one timeout (1.5 s) apart.
  auto apart = std::chrono::steady_clock::duration(std::abs(silent_a.hello_at.load() - silent_b.hello_at.load()));
  EXPECT_GT(silent_a.hello_at.load(), 0);
  EXPECT_GT(silent_b.hello_at.load(), 0);
  EXPECT_LT(std::chrono::duration<double>(apart).count(), 1.0);
  ASSERT_EQ(rets.size(), 3U);
  EXPECT_EQ(rets[0], LLM_LINK_FAILED);
  EXPECT_EQ(rets[1], LLM_SUCCESS);
  EXPECT_EQ(rets[2], LLM_LINK_FAILED);
  rets = {LLM_FAILED};  // as CANN: each call appends its codes, and reports the last failure
  EXPECT_EQ(dd.LinkLlmClusters({ddtest::Cluster(3, port), ddtest::Cluster(2, 1)}, rets, 500), LLM_LINK_FAILED);
  EXPECT_EQ(rets, (std::vector<Status>{LLM_FAILED, LLM_ALREADY_LINK, LLM_LINK_FAILED}));
  rets.clear();
  // cluster 2 was never linked: forced, nothing to drop; without force, CANN dials its
  // listener to tell it, and nobody answers at port 1
  EXPECT_EQ(dd.UnlinkLlmClusters({ddtest::Cluster(2, 1), ddtest::Cluster(3, port)}, rets), LLM_UNLINK_FAILED);
  EXPECT_EQ(rets, (std::vector<Status>{LLM_UNLINK_FAILED, LLM_SUCCESS}));
  rets.clear();
  EXPECT_EQ(dd.UnlinkLlmClusters({ddtest::Cluster(2, 1)}, rets, 1000, true), LLM_SUCCESS);
  EXPECT_EQ(dd.UnlinkLlmClusters({ddtest::Cluster(3, port)}, rets), LLM_SUCCESS);  // its listener answers
  ClusterInfo two_ips = ddtest::Cluster(3, port);
  two_ips.remote_ip_infos.push_back(two_ips.remote_ip_infos[0]);
  rets.clear();
  EXPECT_EQ(dd.UnlinkLlmClusters({two_ips}, rets), LLM_PARAM_INVALID);  // needs exactly one, unless forced
  EXPECT_EQ(dd.UnlinkLlmClusters({two_ips}, rets, 1000, true), LLM_SUCCESS);
  EXPECT_EQ(dd.LinkLlmClusters({two_ips}, rets), LLM_PARAM_INVALID);
  EXPECT_EQ(rets.back(), LLM_PARAM_INVALID);
}

// Two threads linking to one cluster at once (a deployment's retry racing its first try): one
// links, the other waits for it and is LLM_ALREADY_LINK, never a LINK_FAILED caused by the
// first link's reverse channel holding the peer's slot for us; and the link works.
TEST(Deadlines, TwoLinksToOneClusterAtOnceAreOneLinkAndOneAlreadyLink) {
  uint16_t port = ddtest::FreePort();
  HostCache src{4, {4, 16}}, dst{4, {4, 16}};
  for (int round = 0; round < 5; ++round) {
    LlmDataDist prompt(kPrompt, LlmRole::kPrompt), decoder(kDecoder, LlmRole::kDecoder);
    ASSERT_EQ(prompt.Initialize(ddtest::Options(port)), LLM_SUCCESS);
    ASSERT_EQ(decoder.Initialize(ddtest::Options(0, "1000")), LLM_SUCCESS);
    ASSERT_EQ(src.Register(prompt), LLM_SUCCESS);
    ASSERT_EQ(dst.Register(decoder), LLM_SUCCESS);
    src.Fill(static_cast<uint8_t>(round + 1));
    Status got[2] = {LLM_FAILED, LLM_FAILED};
    std::thread a([&] {
      std::vector<Status> rets;
      got[0] = decoder.LinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 5000);
    });
    std::thread b([&] {
      std::vector<Status> rets;
      got[1] = decoder.LinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 5000);
    });
    a.join();
    b.join();
    EXPECT_EQ(std::min(got[0], got[1]), LLM_SUCCESS) << round;
    EXPECT_EQ(std::max(got[0], got[1]), LLM_ALREADY_LINK) << round;
    ASSERT_EQ(decoder.PullKvCache(Index(kPrompt, src.cache.cache_id, 1), dst.cache, 2), LLM_SUCCESS) << round;
    for (int t = 0; t < 4; ++t) EXPECT_EQ(std::memcmp(dst.T(t) + 32, src.T(t) + 16, 16), 0) << round << t;
    prompt.Finalize();
    decoder.Finalize();
  }
}

TEST(Auth, SharedSecretLinksAndAWrongOneDoesNot) {
  uint16_t port = ddtest::FreePort();
  HostCache src(2, {4, 16}), dst(2, {4, 16});
  auto with_secret = [](uint16_t listen, const char *secret) {
    auto o = ddtest::Options(listen);
    if (secret) o["datadist.AuthSecret"] = secret;
    return o;
  };
  LlmDataDist owner(1, LlmRole::kPrompt);
  ASSERT_EQ(owner.Initialize(with_secret(port, "s3cret")), LLM_SUCCESS);
  ASSERT_EQ(src.Register(owner), LLM_SUCCESS);
  src.Fill(8);
  std::vector<Status> rets;
  for (const char *bad : {"wrong", static_cast<const char *>(nullptr)}) {
    LlmDataDist other(2, LlmRole::kDecoder);
    ASSERT_EQ(other.Initialize(with_secret(0, bad)), LLM_SUCCESS);
    EXPECT_EQ(other.LinkLlmClusters({ddtest::Cluster(1, port)}, rets, 2000), LLM_LINK_FAILED) << (bad ? bad : "none");
  }
  // an owner without a secret cannot satisfy a client that has one
  uint16_t open_port = ddtest::FreePort();
  LlmDataDist open_owner(3, LlmRole::kPrompt);
  ASSERT_EQ(open_owner.Initialize(ddtest::Options(open_port)), LLM_SUCCESS);
  LlmDataDist client(2, LlmRole::kDecoder);
  ASSERT_EQ(client.Initialize(with_secret(0, "s3cret")), LLM_SUCCESS);
  EXPECT_EQ(client.LinkLlmClusters({ddtest::Cluster(3, open_port)}, rets, 2000), LLM_LINK_FAILED);
  ASSERT_EQ(client.LinkLlmClusters({ddtest::Cluster(1, port)}, rets, 2000), LLM_SUCCESS);
  ASSERT_EQ(dst.Register(client), LLM_SUCCESS);
  ASSERT_EQ(client.PullKvCache(Index(1, 1, 3), dst.cache, 0), LLM_SUCCESS);
  EXPECT_EQ(std::memcmp(dst.T(1), src.T(1) + 48, 16), 0);
  client.Finalize();
  // linked with another id than the owner's: the secret is proved for the id it announces
  LlmDataDist any_id(4, LlmRole::kDecoder);
  ASSERT_EQ(any_id.Initialize(with_secret(0, "s3cret")), LLM_SUCCESS);
  EXPECT_EQ(any_id.LinkLlmClusters({ddtest::Cluster(0, port)}, rets, 2000), LLM_SUCCESS);
  any_id.Finalize();
}

TEST(Reverse, ANonListeningDecoderIsPushedToOverItsOwnLink) {
  uint16_t port = ddtest::FreePort();
  HostCache src(4, {4, 16}), dst(4, {4, 16}), back(4, {4, 16});
  LlmDataDist p(kPrompt, LlmRole::kPrompt), d(kDecoder, LlmRole::kDecoder);
  ASSERT_EQ(p.Initialize(ddtest::Options(port)), LLM_SUCCESS);
  ASSERT_EQ(d.Initialize(ddtest::Options()), LLM_SUCCESS);  // never listens
  ASSERT_EQ(src.Register(p), LLM_SUCCESS);
  ASSERT_EQ(back.Register(p), LLM_SUCCESS);
  ASSERT_EQ(dst.Register(d), LLM_SUCCESS);
  src.Fill(5);
  std::vector<Status> rets;
  EXPECT_EQ(p.PushKvCache(src.cache, Index(kDecoder, 1)), LLM_NOT_YET_LINK);
  ASSERT_EQ(d.LinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 5000), LLM_SUCCESS);
  // the prompt pushes to the decoder's cluster id over the decoder's link
  ASSERT_EQ(p.PushKvBlocks(src.cache, Index(kDecoder, 1), {0, 3}, {2, 1}), LLM_SUCCESS);
  ASSERT_EQ(p.PushKvCache(src.cache, Index(kDecoder, 1, 0), 2), LLM_SUCCESS);
  for (int t = 0; t < 4; ++t) {
    EXPECT_EQ(std::memcmp(dst.T(t), src.T(t) + 32, 16), 0);
    EXPECT_EQ(std::memcmp(dst.T(t) + 16, src.T(t) + 48, 16), 0);
    EXPECT_EQ(std::memcmp(dst.T(t) + 32, src.T(t), 16), 0);
    for (int i = 48; i < 64; ++i) ASSERT_EQ(dst.T(t)[i], 0);
  }
  // and pulls from it; the decoder's owner checks apply
  ASSERT_EQ(p.PullKvCache(Index(kDecoder, 1, 1), back.cache, 3), LLM_SUCCESS);
  EXPECT_EQ(std::memcmp(back.T(2) + 48, src.T(2) + 48, 16), 0);
  EXPECT_EQ(p.PushKvBlocks(src.cache, Index(kDecoder, 1), {0}, {4}), LLM_PARAM_INVALID);
  EXPECT_EQ(p.PushKvBlocks(src.cache, Index(kDecoder, 7), {0}, {0}), LLM_KV_CACHE_NOT_EXIST);
  // the decoder unlinks: the prompt's end fails until it links again
  ASSERT_EQ(d.UnlinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 5000), LLM_SUCCESS);
  EXPECT_EQ(p.PushKvCache(src.cache, Index(kDecoder, 1)), LLM_LINK_FAILED);
  ASSERT_EQ(d.LinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 5000), LLM_SUCCESS);
  EXPECT_EQ(p.PushKvCache(src.cache, Index(kDecoder, 1, 3), 3), LLM_SUCCESS);
  EXPECT_EQ(std::memcmp(dst.T(0) + 48, src.T(0) + 48, 16), 0);
  // the prompt unlinks its end (BYE on the reverse channel)
  ASSERT_EQ(p.UnlinkLlmClusters({ddtest::Cluster(kDecoder, 1)}, rets, 5000), LLM_SUCCESS);
  EXPECT_EQ(p.PushKvCache(src.cache, Index(kDecoder, 1)), LLM_NOT_YET_LINK);
  EXPECT_EQ(d.PullKvCache(Index(kPrompt, 1), dst.cache), LLM_SUCCESS);  // the decoder's own end stays
  d.Finalize();
  p.Finalize();
}

TEST(Xllm, PerLayerCachesPullThenLayerwisePush) {
  // xLLM: a K and a V cache of one tensor per layer, registered in the same order on both
  // sides, so each side addresses the remote cache by its own local id.
  constexpr int kLayers = 3;
  uint16_t pport = ddtest::FreePort(), dport = ddtest::FreePort();
  HostCache pk(kLayers, {8, 32}), pv(kLayers, {8, 32}), dk(kLayers, {8, 32}), dv(kLayers, {8, 32});
  HostCache one(1, {8, 32});
  // What the prompt computes next (filled before any transfer: rewriting memory a peer has just
  // read is ordered by the socket, which ThreadSanitizer cannot see within one process).
  HostCache pk2(kLayers, {8, 32}), pv2(kLayers, {8, 32});
  pk2.Fill(31);
  pv2.Fill(32);
  LlmDataDist p(kPrompt, LlmRole::kPrompt), d(kDecoder, LlmRole::kDecoder);
  ASSERT_EQ(p.Initialize(ddtest::Options(pport)), LLM_SUCCESS);
  ASSERT_EQ(d.Initialize(ddtest::Options(dport)), LLM_SUCCESS);
  ASSERT_EQ(pk.Register(p), LLM_SUCCESS);
  ASSERT_EQ(pv.Register(p), LLM_SUCCESS);
  ASSERT_EQ(dk.Register(d), LLM_SUCCESS);
  ASSERT_EQ(dv.Register(d), LLM_SUCCESS);
  pk.Fill(21);
  pv.Fill(22);
  ASSERT_EQ(pk2.Register(p), LLM_SUCCESS);
  ASSERT_EQ(pv2.Register(p), LLM_SUCCESS);
  std::vector<Status> rets;
  ASSERT_EQ(d.LinkLlmClusters({ddtest::Cluster(kPrompt, pport)}, rets, 5000), LLM_SUCCESS);
  ASSERT_EQ(p.LinkLlmClusters({ddtest::Cluster(kDecoder, dport)}, rets, 5000), LLM_SUCCESS);
  std::vector<uint64_t> blocks = {5, 1, 2};
  for (HostCache *c : {&dk, &dv}) {
    Cache only_id{};
    only_id.cache_id = c->cache.cache_id;
    for (int32_t l = 0; l < kLayers; ++l)
      ASSERT_EQ(d.PullKvBlocks(Index(kPrompt, c->cache.cache_id), only_id, blocks, blocks, Ext({l, l}, {l, l}, 1)),
                LLM_SUCCESS);
  }
  // {0, 0} with one tensor per layer: layer 0 only
  ASSERT_EQ(one.Register(d), LLM_SUCCESS);
  ASSERT_EQ(d.PullKvBlocks(Index(kPrompt, 1), one.cache, {7}, {0}, Ext({0, 0}, {0, 0}, 1)), LLM_SUCCESS);
  EXPECT_EQ(std::memcmp(one.T(0), pk.T(0) + 7 * 32, 32), 0);
  for (int l = 0; l < kLayers; ++l)
    for (uint64_t b = 0; b < 8; ++b) {
      bool moved = b == 5 || b == 1 || b == 2;
      for (int kv = 0; kv < 2; ++kv) {
        HostCache &from = kv ? pv : pk;
        HostCache &to = kv ? dv : dk;
        for (int i = 0; i < 32; ++i) ASSERT_EQ(to.T(l)[b * 32 + i], moved ? from.T(l)[b * 32 + i] : 0) << l << " " << b;
      }
    }
  // the prompt pushes new blocks layer by layer, as each layer is computed
  for (int32_t l = 0; l < kLayers; ++l) {
    ASSERT_EQ(p.PushKvBlocks(pk2.cache, Index(kDecoder, dk.cache.cache_id), {3}, {6}, Ext({l, l}, {l, l}, 1)),
              LLM_SUCCESS);
    ASSERT_EQ(p.PushKvBlocks(pv2.cache, Index(kDecoder, dv.cache.cache_id), {3}, {6}, Ext({l, l}, {l, l}, 1)),
              LLM_SUCCESS);
    for (int later = l + 1; later < kLayers; ++later)  // not yet pushed
      for (int i = 0; i < 32; ++i) ASSERT_EQ(dk.T(later)[6 * 32 + i], 0);
    EXPECT_EQ(std::memcmp(dk.T(l) + 6 * 32, pk2.T(l) + 3 * 32, 32), 0);
    EXPECT_EQ(std::memcmp(dv.T(l) + 6 * 32, pv2.T(l) + 3 * 32, 32), 0);
  }
}

TEST(Concurrency, PullsFromManyThreadsOnOneLink) {
  uint16_t port = ddtest::FreePort();
  constexpr int kThreads = 4;
  HostCache src(2, {16, 64});
  std::vector<std::unique_ptr<HostCache>> dsts;
  LlmDataDist p(1, LlmRole::kPrompt), d(2, LlmRole::kDecoder);
  ASSERT_EQ(p.Initialize(ddtest::Options(port)), LLM_SUCCESS);
  ASSERT_EQ(d.Initialize(ddtest::Options(0, "5000")), LLM_SUCCESS);
  ASSERT_EQ(src.Register(p), LLM_SUCCESS);
  src.Fill(3);
  std::vector<Status> rets;
  ASSERT_EQ(d.LinkLlmClusters({ddtest::Cluster(1, port)}, rets, 5000), LLM_SUCCESS);
  for (int i = 0; i < kThreads; ++i) {
    dsts.push_back(std::make_unique<HostCache>(2, std::vector<int64_t>{16, 64}));
    ASSERT_EQ(dsts.back()->Register(d), LLM_SUCCESS);
  }
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&, i] {
      for (uint32_t slot = 0; slot < 16; ++slot)
        if (d.PullKvCache(Index(1, 1, slot), dsts[i]->cache, slot) != LLM_SUCCESS) ++failures;
    });
  for (auto &t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  for (auto &c : dsts)
    for (int t = 0; t < 2; ++t) EXPECT_EQ(std::memcmp(c->T(t), src.T(t), 16 * 64), 0);
}

}  // namespace

namespace hostile {

// A raw client speaking the wire directly, to feed the C++ owner what a library never sends.
class Raw {
 public:
  explicit Raw(uint16_t port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    connected = connect(fd_, reinterpret_cast<sockaddr *>(&a), sizeof(a)) == 0;
    timeval tv{3, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~Raw() { close(fd_); }
  void Send(const std::vector<uint8_t> &b) {
    ASSERT_EQ(send(fd_, b.data(), b.size(), MSG_NOSIGNAL), static_cast<ssize_t>(b.size()));
  }
  /// The next frame's header and payload; type 0 when the owner closed the connection.
  std::pair<datadist::wire::Header, std::vector<uint8_t>> Recv() {
    uint8_t head[12];
    if (!Exactly(head, 12)) return {};
    datadist::wire::Header h = datadist::wire::DecodeHeader(head);
    std::vector<uint8_t> payload(h.length);
    if (h.length && !Exactly(payload.data(), h.length)) return {};
    return {h, payload};
  }
  std::vector<uint8_t> RecvRaw(size_t n) {
    std::vector<uint8_t> out(n);
    if (!Exactly(out.data(), n)) out.clear();
    return out;
  }
  bool Closed() {
    uint8_t b;
    return recv(fd_, &b, 1, 0) == 0;
  }
  bool connected = false;

 private:
  bool Exactly(uint8_t *p, size_t n) {
    while (n) {
      ssize_t got = recv(fd_, p, n, 0);
      if (got <= 0) return false;
      p += got;
      n -= static_cast<size_t>(got);
    }
    return true;
  }
  int fd_;
};

TEST(Hostile, OwnerRefusesMalformedInputAndKeepsServing) {
  uint16_t port = ddtest::FreePort();
  HostCache src(2, {4, 16});
  LlmDataDist owner(9, LlmRole::kPrompt);
  ASSERT_EQ(owner.Initialize(ddtest::Options(port)), LLM_SUCCESS);
  ASSERT_EQ(src.Register(owner), LLM_SUCCESS);
  src.Fill(4);
  namespace w = datadist::wire;
  {  // garbage instead of a HELLO: ERROR, then closed
    Raw r(port);
    ASSERT_TRUE(r.connected);
    r.Send(std::vector<uint8_t>(12, 'x'));
    auto [eh, ep] = r.Recv();
    EXPECT_EQ(eh.type, w::kError);
    EXPECT_EQ(w::DecodeError(ep).code, static_cast<int64_t>(datadist::kSuspectRemoteError));
    EXPECT_TRUE(r.Closed());
  }
  {  // a HELLO over the 4096-byte pre-handshake cap: closed before its payload is read
    Raw r(port);
    w::Hello big;
    big.cluster_id = 10;
    big.proof = std::string(5000, 'p');
    r.Send(w::EncodeHello(w::kHello, big, 1));
    auto [eh, ep] = r.Recv();
    EXPECT_EQ(eh.type, w::kError);
    EXPECT_TRUE(r.Closed());
  }
  {  // ourselves (our cluster id, pid, boot id and pid namespace): ERROR LLM_LINK_FAILED, then
     // closed. Another process with our cluster id is a peer (vllm-ascend's V0 connector).
    Raw r(port);
    w::Hello h;
    h.cluster_id = 9;
    h.pid = static_cast<uint32_t>(getpid());
    h.boot_id = datadist::local::HostIdentity::Current().boot_id;
    h.pid_ns = datadist::local::HostIdentity::Current().pid_ns;
    r.Send(w::EncodeHello(w::kHello, h, 1));
    auto [head, payload] = r.Recv();
    ASSERT_EQ(head.type, w::kError);
    EXPECT_EQ(w::DecodeError(payload).code, static_cast<int64_t>(LLM_LINK_FAILED));
    EXPECT_TRUE(r.Closed());
  }
  Raw r(port);
  w::Hello h;
  h.cluster_id = 10;
  r.Send(w::EncodeHello(w::kHello, h, 1));
  auto [head, payload] = r.Recv();
  ASSERT_EQ(head.type, w::kWelcome);
  w::Hello welcome = w::DecodeHello(payload);
  EXPECT_EQ(welcome.cluster_id, 9U);
  // who we are, as Python says it: a same-host client may try our local channel
  EXPECT_EQ(welcome.pid, static_cast<uint32_t>(getpid()));
  EXPECT_EQ(welcome.pid_ns, datadist::local::HostIdentity::Current().pid_ns);
  EXPECT_NE(welcome.pid_ns, 0U);
  EXPECT_EQ(welcome.boot_id, datadist::local::HostIdentity::Current().boot_id);
  EXPECT_NE(welcome.boot_id, (std::array<uint8_t, 16>{}));
  // a control channel's WELCOME carries its link token, for its reverse channel to echo
  EXPECT_EQ(welcome.features,
            w::kFeatureReverse | w::kFeatureLocal | w::kFeatureLease | w::kFeatureToken | w::kFeatureEagerWrite);
  EXPECT_EQ(w::SplitToken(welcome.proof, welcome.features).second.size(), w::kLinkTokenBytes);
  auto ask = [&](uint8_t type, w::Request q, uint32_t rid) {
    r.Send(w::EncodeRequest(type, q, rid));
    return r.Recv();
  };
  w::Request q;
  q.kind = w::kCacheId;
  q.a = 1;
  q.tensors = {0, 1};
  q.offsets = {0};
  q.lengths = {64};
  // spans past the tensor, tensor indexes past the cache, overflowing offsets, a grant:
  // each answered by ERROR with its code, and the connection stays usable
  struct Case {
    std::vector<uint32_t> tensors;
    uint64_t offset, length, slot;
    uint32_t flags;
    Status code;
  } cases[] = {
      {{0}, 1, 64, 0, 0, LLM_PARAM_INVALID},
      {{2}, 0, 16, 0, 0, LLM_PARAM_INVALID},
      {{0}, ~0ULL - 3, 8, 0, 0, LLM_PARAM_INVALID},
      {{0}, 0, 16, 4, 0, LLM_PARAM_INVALID},
      {{0}, 16, 48, 1, 0, LLM_PARAM_INVALID},             // slot 1 leaves 48 bytes: 16 + 48 runs past
      {{0}, 0, 16, 0, w::kFlagGrant, LLM_PARAM_INVALID},  // grants: local channel only
      {{1, 0, 1}, 0, 16, 0, 0, LLM_PARAM_INVALID},        // a tensor named twice
  };
  uint32_t rid = 2;
  for (const Case &c : cases) {
    w::Request bad = q;
    bad.tensors = c.tensors;
    bad.offsets = {c.offset};
    bad.lengths = {c.length};
    bad.b = c.slot;
    bad.flags = c.flags;
    auto [eh, ep] = ask(w::kRead, bad, rid);
    ASSERT_EQ(eh.type, w::kError) << c.offset;
    EXPECT_EQ(eh.request_id, rid);
    EXPECT_EQ(w::DecodeError(ep).code, static_cast<int64_t>(c.code));
    ++rid;
  }
  // a WRITE naming raw addresses outside every cache: nothing lands (and the answer is the
  // one every address refusal gets: no address oracle)
  w::Request raw;
  raw.kind = w::kAddress;
  raw.tensors = {0};
  raw.offsets = {8};
  raw.lengths = {8};
  auto [wh, wp] = ask(w::kWrite, raw, rid++);
  ASSERT_EQ(wh.type, w::kError);
  EXPECT_EQ(w::DecodeError(wp).code, static_cast<int64_t>(LLM_PARAM_INVALID));
  // still serving: a good READ returns exactly the bytes
  auto [rh, rp] = ask(w::kRead, q, rid);
  ASSERT_EQ(rh.type, w::kReadData);
  ASSERT_EQ(w::DecodeU64(rp), 128U);
  std::vector<uint8_t> data = r.RecvRaw(128);
  ASSERT_EQ(data.size(), 128U);
  EXPECT_EQ(std::memcmp(data.data(), src.T(0), 64), 0);
  EXPECT_EQ(std::memcmp(data.data() + 64, src.T(1), 64), 0);
  r.Send(w::EncodeU64(w::kPing, 5, rid + 1));
  auto [ph, pp] = r.Recv();
  ASSERT_EQ(ph.type, w::kPong);
  EXPECT_EQ(w::DecodeU64(pp), 5U);
  // an array count beyond the payload: the owner closes (after an ERROR)
  auto frame = w::EncodeRequest(w::kRead, q, 99);
  frame[12 + 1 + 24 + 8 + 8 + 4 + 3] = 0x7F;
  Raw r2(port);
  r2.Send(w::EncodeHello(w::kHello, h, 1));
  ASSERT_EQ(r2.Recv().first.type, w::kWelcome);
  r2.Send(frame);
  auto [ch, cp] = r2.Recv();
  EXPECT_EQ(ch.type, w::kError);
  EXPECT_TRUE(r2.Closed());
  // and a real client still links and pulls
  HostCache dst(2, {4, 16});
  LlmDataDist client(11, LlmRole::kDecoder);
  ASSERT_EQ(client.Initialize(ddtest::Options()), LLM_SUCCESS);
  ASSERT_EQ(dst.Register(client), LLM_SUCCESS);
  std::vector<Status> rets;
  ASSERT_EQ(client.LinkLlmClusters({ddtest::Cluster(9, port)}, rets, 5000), LLM_SUCCESS);
  ASSERT_EQ(client.PullKvCache(Index(9, 1, 2), dst.cache, 2), LLM_SUCCESS);
  EXPECT_EQ(std::memcmp(dst.T(1) + 32, src.T(1) + 32, 16), 0);
  client.Finalize();
}

TEST(Hostile, ConnectionCapsPerPeer) {
  uint16_t port = ddtest::FreePort();
  LlmDataDist owner(9, LlmRole::kPrompt);
  auto o = ddtest::Options(port);
  o["datadist.MaxConnectionsPerPeer"] = "2";
  ASSERT_EQ(owner.Initialize(o), LLM_SUCCESS);
  namespace w = datadist::wire;
  w::Hello h;
  h.cluster_id = 10;
  auto greeted = [&](Raw &r) {
    r.Send(w::EncodeHello(w::kHello, h, 1));
    return r.Recv().first.type == w::kWelcome;
  };
  auto a = std::make_unique<Raw>(port);
  Raw b(port);
  ASSERT_TRUE(greeted(*a));
  ASSERT_TRUE(greeted(b));
  {  // the third from one address: its HELLO is answered with ERROR, by no thread of its own
    Raw c(port);
    c.Send(w::EncodeHello(w::kHello, h, 5));
    auto t0 = std::chrono::steady_clock::now();
    auto [eh, ep] = c.Recv();
    ASSERT_EQ(eh.type, w::kError);
    EXPECT_EQ(eh.request_id, 5U);
    EXPECT_EQ(w::DecodeError(ep).code, static_cast<int64_t>(LLM_LINK_FAILED));
    EXPECT_NE(w::DecodeError(ep).message.find("too many connections"), std::string::npos);
    EXPECT_TRUE(c.Closed());
    EXPECT_LT(Seconds(t0), 1.0);
  }
  {  // one that never sends a frame is closed after the refusal's 2 s, without a word
    Raw silent(port);
    auto t0 = std::chrono::steady_clock::now();
    EXPECT_TRUE(silent.Closed());
    EXPECT_GT(Seconds(t0), 1.0);
    EXPECT_LT(Seconds(t0), 3.5);
  }
  a.reset();  // one leaves: room again (once its thread has ended)
  bool served = false;
  for (int i = 0; i < 50 && !served; ++i) {
    Raw d(port);
    served = greeted(d);
    if (!served) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(served);
  LlmDataDist bad(1, LlmRole::kPrompt);
  o["datadist.MaxConnectionsPerPeer"] = "0";
  EXPECT_EQ(bad.Initialize(o), LLM_PARAM_INVALID);
}

}  // namespace hostile

namespace {

// CANN's LinkMsgHandler (hicann/hixl src/llm_datadist/link_mgr/link_msg_handler.cc) files a
// link under the cluster id the peer reports (AddEntity(peer_exchange_info.cluster_id)) and
// never compares it with the remote_cluster_id passed; its own C++ tests link with the id
// left at 0. The link is then known by the peer's id only: a pull naming the id passed finds
// no link (LLM_NOT_YET_LINK), as there.
TEST(LinkIds, ALinkIsFiledUnderTheIdThePeerReports) {
  HostCache src{2, {4, 16}};
  HostCache dst{2, {4, 16}};
  LlmDataDist prompt{7, LlmRole::kPrompt};
  LlmDataDist decoder{9, LlmRole::kDecoder};
  uint16_t port = ddtest::FreePort();
  ASSERT_EQ(prompt.Initialize(ddtest::Options(port)), LLM_SUCCESS);
  ASSERT_EQ(decoder.Initialize(ddtest::Options(0, "1000")), LLM_SUCCESS);
  ASSERT_EQ(src.Register(prompt), LLM_SUCCESS);
  ASSERT_EQ(dst.Register(decoder), LLM_SUCCESS);
  src.Fill(3);
  std::vector<Status> rets;
  ASSERT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(0, port)}, rets, 3000), LLM_SUCCESS);
  ASSERT_EQ(rets, std::vector<Status>{LLM_SUCCESS});
  EXPECT_EQ(decoder.PullKvCache(Index(0, 1, 0), dst.cache, 0), LLM_NOT_YET_LINK);
  ASSERT_EQ(decoder.PullKvCache(Index(7, 1, 2), dst.cache, 1), LLM_SUCCESS);
  EXPECT_EQ(std::memcmp(dst.T(1) + 16, src.T(1) + 32, 16), 0);
  // linked under 7: a second link by that id is LLM_ALREADY_LINK
  EXPECT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(7, port)}, rets, 3000), LLM_ALREADY_LINK);
  EXPECT_EQ(decoder.UnlinkLlmClusters({ddtest::Cluster(7, port)}, rets, 3000, true), LLM_SUCCESS);
  EXPECT_EQ(decoder.PullKvCache(Index(7, 1, 2), dst.cache, 1), LLM_NOT_YET_LINK);
  decoder.Finalize();
  prompt.Finalize();
}

}  // namespace

namespace {

// The sequence of hicann/hixl examples/python/hixl_transfer_backend_sample.py with the HIXL
// backend: each side listens and links to the other, the prompt pulls and the decoder pushes,
// then both unlink at once naming only remote_cluster_id (no ip info, no force). CANN's
// HixlTransferEngine::UnlinkCluster destroys the link of that id whatever force says; each
// unlink is LLM_SUCCESS and afterwards neither side has a link (SetRole, which needs none,
// succeeds), and unlinking again is LLM_SUCCESS too.
TEST(Hixl, UnlinkNeedsNoAddressAndBothEndsEndUnlinked) {
  HostCache pc{2, {3, 40}};
  HostCache dc{2, {3, 40}};
  LlmDataDist prompt{0, LlmRole::kPrompt};
  LlmDataDist decoder{1, LlmRole::kDecoder};
  uint16_t pport = ddtest::FreePort(), dport = ddtest::FreePort();
  auto po = ddtest::Options(pport), dopt = ddtest::Options(dport);
  po[OPTION_TRANSFER_BACKEND] = dopt[OPTION_TRANSFER_BACKEND] = "hixl";
  ASSERT_EQ(prompt.Initialize(po), LLM_SUCCESS);
  ASSERT_EQ(decoder.Initialize(dopt), LLM_SUCCESS);
  ASSERT_EQ(pc.Register(prompt), LLM_SUCCESS);
  ASSERT_EQ(dc.Register(decoder), LLM_SUCCESS);
  pc.Fill(1);
  dc.Fill(2);
  std::vector<Status> rets;
  Status pl = LLM_FAILED, dl = LLM_FAILED;
  std::thread a([&] {
    std::vector<Status> r;
    pl = prompt.LinkLlmClusters({ddtest::Cluster(1, dport)}, r, 5000);
  });
  std::thread b([&] {
    std::vector<Status> r;
    dl = decoder.LinkLlmClusters({ddtest::Cluster(0, pport)}, r, 5000);
  });
  a.join();
  b.join();
  ASSERT_EQ(pl, LLM_SUCCESS);
  ASSERT_EQ(dl, LLM_SUCCESS);
  ASSERT_EQ(prompt.PullKvBlocks(Index(1, 1), pc.cache, {2}, {2}), LLM_SUCCESS);
  ASSERT_EQ(decoder.PushKvBlocks(dc.cache, Index(0, 1), {0, 1}, {0, 1}), LLM_SUCCESS);
  EXPECT_EQ(std::memcmp(pc.T(0), dc.T(0), 120), 0);
  EXPECT_EQ(std::memcmp(pc.T(1), dc.T(1), 120), 0);
  ClusterInfo to_decoder{}, to_prompt{};
  to_decoder.remote_cluster_id = 1;
  to_prompt.remote_cluster_id = 0;
  Status pu = LLM_FAILED, du = LLM_FAILED;
  std::thread c([&] {
    std::vector<Status> r;
    pu = prompt.UnlinkLlmClusters({to_decoder}, r, 5000);
  });
  std::thread d([&] {
    std::vector<Status> r;
    du = decoder.UnlinkLlmClusters({to_prompt}, r, 5000);
  });
  c.join();
  d.join();
  EXPECT_EQ(pu, LLM_SUCCESS);
  EXPECT_EQ(du, LLM_SUCCESS);
  EXPECT_EQ(prompt.PullKvBlocks(Index(1, 1), pc.cache, {2}, {2}), LLM_NOT_YET_LINK);
  EXPECT_EQ(decoder.PushKvBlocks(dc.cache, Index(0, 1), {0}, {0}), LLM_NOT_YET_LINK);
  EXPECT_EQ(prompt.SetRole(LlmRole::kPrompt, po), LLM_SUCCESS);
  EXPECT_EQ(decoder.SetRole(LlmRole::kDecoder, dopt), LLM_SUCCESS);
  EXPECT_EQ(prompt.UnlinkLlmClusters({to_decoder}, rets, 5000, true), LLM_SUCCESS);
  decoder.Finalize();
  prompt.Finalize();
}

}  // namespace

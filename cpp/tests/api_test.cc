// Every entry point's argument checks and status codes, in one process, without a peer.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "test_util.h"

namespace {

using namespace llm_datadist;
using ddtest::HostCache;

TEST(Api, StatusCodesHavePythonsValues) {
  // datadist.LLMStatusCode's values (src/datadist/core/errors.py)
  EXPECT_EQ(LLM_SUCCESS, 0U);
  EXPECT_EQ(LLM_FAILED, 0xFFFFFFFFU);
  EXPECT_EQ(LLM_WAIT_PROC_TIMEOUT, 0x5010B001U);
  EXPECT_EQ(LLM_KV_CACHE_NOT_EXIST, 0x5010B002U);
  EXPECT_EQ(LLM_PARAM_INVALID, 0x5010B005U);
  EXPECT_EQ(LLM_NOT_YET_LINK, 0x5010B007U);
  EXPECT_EQ(LLM_ALREADY_LINK, 0x5010B008U);
  EXPECT_EQ(LLM_LINK_FAILED, 0x5010B009U);
  EXPECT_EQ(LLM_UNLINK_FAILED, 0x5010B00AU);
  EXPECT_EQ(LLM_NOTIFY_PROMPT_UNLINK_FAILED, 0x5010B00BU);
  EXPECT_EQ(LLM_CLUSTER_NUM_EXCEED_LIMIT, 0x5010B00CU);
  EXPECT_EQ(LLM_PROCESSING_LINK, 0x5010B00DU);
  EXPECT_EQ(LLM_DEVICE_OUT_OF_MEMORY, 0x5010B00EU);
  EXPECT_EQ(LLM_EXIST_LINK, 0x5010B018U);
  EXPECT_EQ(LLM_FEATURE_NOT_ENABLED, 0x5010B019U);
  EXPECT_EQ(LLM_TIMEOUT, 0x5010B01AU);
  EXPECT_EQ(LLM_LINK_BUSY, 0x5010B01BU);
  EXPECT_EQ(LLM_OUT_OF_MEMORY, 0x5010B01CU);
}

TEST(Api, TypesAsClientsUseThem) {
  std::map<AscendString, AscendString> options;
  options[OPTION_LISTEN_IP_INFO] = "127.0.0.1:26000";
  options["llm.SyncKvCacheWaitTime"] = "500";
  EXPECT_STREQ(options[AscendString("llm.ListenIpInfo")].GetString(), "127.0.0.1:26000");
  EXPECT_EQ(options.size(), 2U);
  EXPECT_EQ(ge::DT_INT32, 3);
  EXPECT_EQ(DT_BF16, 27);
  EXPECT_EQ(static_cast<int>(LlmRole::kPrompt), 1);
  EXPECT_EQ(static_cast<uint32_t>(CachePlacement::kDevice), 1U);
  CacheIndex idx{5, 1, 0, {}};
  EXPECT_EQ(idx.cluster_id, 5U);
  KvCacheExtParam ext{};
  EXPECT_EQ(ext.src_layer_range, std::make_pair(-1, -1));
  EXPECT_EQ(ext.tensor_num_per_layer, 2);
  Cache c{};
  EXPECT_EQ(c.cache_id, -1);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%u", LLM_TIMEOUT);  // ge::Status prints with %u
  EXPECT_STREQ(buf, "1343270938");
}

TEST(Api, EveryCallBeforeInitializeAndAfterFinalizeFails) {
  for (int finalized = 0; finalized < 2; ++finalized) {
    LlmDataDist dd(1, LlmRole::kDecoder);
    if (finalized) {
      ASSERT_EQ(dd.Initialize(ddtest::Options()), LLM_SUCCESS);
      dd.Finalize();
      dd.Finalize();  // idempotent
    }
    HostCache h(2, {4, 8});
    int64_t id = -1;
    std::vector<Status> rets;
    Cache cache{};
    cache.cache_id = 1;
    EXPECT_EQ(dd.RegisterKvCache(h.desc, h.addrs, {}, id), LLM_FAILED);
    EXPECT_EQ(dd.UnregisterKvCache(1), LLM_FAILED);
    EXPECT_EQ(dd.AllocateCache(h.desc, cache), LLM_FAILED);
    EXPECT_EQ(dd.DeallocateCache(1), LLM_FAILED);
    EXPECT_EQ(dd.LinkLlmClusters({ddtest::Cluster(2, 1)}, rets), LLM_FAILED);
    EXPECT_EQ(dd.UnlinkLlmClusters({ddtest::Cluster(2, 1)}, rets), LLM_FAILED);
    EXPECT_EQ(dd.PullKvCache(ddtest::Index(2, 1), cache), LLM_FAILED);
    EXPECT_EQ(dd.PullKvBlocks(ddtest::Index(2, 1), cache, {0}, {0}), LLM_FAILED);
    EXPECT_EQ(dd.PushKvCache(cache, ddtest::Index(2, 1)), LLM_FAILED);
    EXPECT_EQ(dd.PushKvBlocks(cache, ddtest::Index(2, 1), {0}, {0}), LLM_FAILED);
    EXPECT_EQ(dd.CopyKvCache(cache, cache), LLM_FAILED);
    EXPECT_EQ(dd.CopyKvBlocks(cache, cache, {0}, {{1}}), LLM_FAILED);
    EXPECT_EQ(dd.SetRole(LlmRole::kPrompt), LLM_FAILED);
    if (finalized) {  // as CANN: Initialize again after Finalize works, ids go on
      ASSERT_EQ(dd.Initialize(ddtest::Options()), LLM_SUCCESS);
      EXPECT_EQ(dd.RegisterKvCache(h.desc, h.addrs, {}, id), LLM_SUCCESS);
      EXPECT_GE(id, 1);
    }
  }
}

TEST(Api, InitializeChecksOptions) {
  LlmDataDist twice(1, LlmRole::kPrompt);
  ASSERT_EQ(twice.Initialize(ddtest::Options()), LLM_SUCCESS);
  EXPECT_EQ(twice.Initialize(ddtest::Options()), LLM_SUCCESS);  // as CANN: already initialized
  for (const char *bad : {"0", "-5", "abc", ""}) {
    LlmDataDist dd(1, LlmRole::kPrompt);
    EXPECT_EQ(dd.Initialize(ddtest::Options(0, bad)), LLM_PARAM_INVALID) << bad;
  }
  for (const char *bad : {"127.0.0.1", "127.0.0.1:", ":80", "127.0.0.1:99999", "localhost:80x", "nohost:80"}) {
    LlmDataDist dd(1, LlmRole::kPrompt);
    auto o = ddtest::Options();
    o[OPTION_LISTEN_IP_INFO] = bad;
    EXPECT_EQ(dd.Initialize(o), LLM_PARAM_INVALID) << bad;
  }
  LlmDataDist hixl(1, LlmRole::kPrompt);
  auto o = ddtest::Options();
  o[OPTION_TRANSFER_BACKEND] = "hixl";  // CANN's samples pass it: accepted
  o[OPTION_LOCAL_COMM_RES] = "{}";
  o[OPTION_BUF_POOL_CFG] = "{}";
  EXPECT_EQ(hixl.Initialize(o), LLM_SUCCESS);
  LlmDataDist other(1, LlmRole::kPrompt);
  o[OPTION_TRANSFER_BACKEND] = "rdma";
  EXPECT_EQ(other.Initialize(o), LLM_PARAM_INVALID);
  LlmDataDist bad_role(1, static_cast<LlmRole>(7));
  EXPECT_EQ(bad_role.Initialize(ddtest::Options()), LLM_PARAM_INVALID);
}

// Issue 22 item 8: the original's LLMUtils::ParseListenIpInfo (hicann/hixl
// src/llm_datadist/common/llm_utils.cc) takes "[ipv6]:port" (and "[ipv4]:port"); a bare IPv6
// address with a port is refused, as are brackets around no address, and a zone id.
TEST(Api, ListenAddressForms) {
  for (const char *bad : {"::1:26000", "fe80::1:26000", "[::1]", "[::1]26000", "[zz]:80", "[::1]:99999",
                          "[::1]:", "[fe80::1%lo]:80", "[]:80", "[::1:80"}) {
    LlmDataDist dd(1, LlmRole::kPrompt);
    auto o = ddtest::Options();
    o[OPTION_LISTEN_IP_INFO] = bad;
    EXPECT_EQ(dd.Initialize(o), LLM_PARAM_INVALID) << bad;
  }
  {
    LlmDataDist dd(1, LlmRole::kPrompt);
    auto o = ddtest::Options();
    o[OPTION_LISTEN_IP_INFO] = "[127.0.0.1]:0";
    EXPECT_EQ(dd.Initialize(o), LLM_SUCCESS);
  }
  if (ddtest::FreePort6() == 0) GTEST_SKIP() << "no IPv6 loopback on this host";
  for (const char *good : {"[::1]:0", "[0:0:0:0:0:0:0:1]:0", "[::]:0"}) {
    LlmDataDist dd(1, LlmRole::kPrompt);
    auto o = ddtest::Options();
    o[OPTION_LISTEN_IP_INFO] = good;
    EXPECT_EQ(dd.Initialize(o), LLM_SUCCESS) << good;
    // and the role switch takes the same forms
    auto s = ddtest::Options();
    s[OPTION_LISTEN_IP_INFO] = "[::1]:0";
    EXPECT_EQ(dd.SetRole(LlmRole::kPrompt, s), LLM_SUCCESS) << good;
    s[OPTION_LISTEN_IP_INFO] = "::1:0";
    EXPECT_EQ(dd.SetRole(LlmRole::kPrompt, s), LLM_PARAM_INVALID) << good;
  }
}

TEST(Api, ListeningOnABusyPortFails) {
  uint16_t port = ddtest::FreePort();
  LlmDataDist a(1, LlmRole::kPrompt), b(2, LlmRole::kPrompt);
  ASSERT_EQ(a.Initialize(ddtest::Options(port)), LLM_SUCCESS);
  EXPECT_EQ(b.Initialize(ddtest::Options(port)), LLM_LINK_FAILED);
}

class Initialized : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(dd.Initialize(ddtest::Options()), LLM_SUCCESS); }
  LlmDataDist dd{1, LlmRole::kDecoder};
};

TEST_F(Initialized, CacheIdsCountFromOneInRegistrationOrder) {
  HostCache a(2, {4, 8}), b(2, {4, 8}), c(1, {2});
  ASSERT_EQ(a.Register(dd), LLM_SUCCESS);
  ASSERT_EQ(b.Register(dd), LLM_SUCCESS);
  Cache alloc{};
  ASSERT_EQ(dd.AllocateCache(c.desc, alloc), LLM_SUCCESS);
  EXPECT_EQ(a.cache.cache_id, 1);
  EXPECT_EQ(b.cache.cache_id, 2);
  EXPECT_EQ(alloc.cache_id, 3);
  ASSERT_EQ(alloc.tensor_addrs.size(), 1U);
  EXPECT_EQ(reinterpret_cast<uint8_t *>(alloc.tensor_addrs[0])[1], 0);  // zeroed
  EXPECT_EQ(dd.UnregisterKvCache(1), LLM_SUCCESS);
  EXPECT_EQ(dd.UnregisterKvCache(1), LLM_SUCCESS);        // gone: no-op, as Python's unregister
  EXPECT_EQ(dd.UnregisterKvCache(99), LLM_SUCCESS);       // unknown: no-op
  EXPECT_EQ(dd.UnregisterKvCache(3), LLM_PARAM_INVALID);  // allocated, not registered
  EXPECT_EQ(dd.DeallocateCache(2), LLM_PARAM_INVALID);    // registered, not allocated
  EXPECT_EQ(dd.DeallocateCache(3), LLM_SUCCESS);
  EXPECT_EQ(dd.DeallocateCache(3), LLM_SUCCESS);  // "does not exist or already freed: success"
  HostCache d(1, {2});
  ASSERT_EQ(d.Register(dd), LLM_SUCCESS);
  EXPECT_EQ(d.cache.cache_id, 4);  // ids are never reused
}

TEST_F(Initialized, RegisterRefusesBadDescriptions) {
  int64_t id = -1;
  HostCache h(2, {4, 8});
  CacheDesc d = h.desc;
  d.num_tensors = 0;
  EXPECT_EQ(dd.RegisterKvCache(d, {}, {}, id), LLM_PARAM_INVALID);
  d = h.desc;
  d.shape = {};
  EXPECT_EQ(dd.RegisterKvCache(d, h.addrs, {}, id), LLM_PARAM_INVALID);
  d.shape = {4, 0};
  EXPECT_EQ(dd.RegisterKvCache(d, h.addrs, {}, id), LLM_PARAM_INVALID);
  d.shape = {-4, 8};
  EXPECT_EQ(dd.RegisterKvCache(d, h.addrs, {}, id), LLM_PARAM_INVALID);
  d = h.desc;
  d.data_type = DT_STRING;
  EXPECT_EQ(dd.RegisterKvCache(d, h.addrs, {}, id), LLM_PARAM_INVALID);
  d.data_type = DT_UNDEFINED;
  EXPECT_EQ(dd.RegisterKvCache(d, h.addrs, {}, id), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.RegisterKvCache(h.desc, {h.addrs[0]}, {}, id), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.RegisterKvCache(h.desc, {h.addrs[0], 0}, {}, id), LLM_PARAM_INVALID);
  d = h.desc;
  d.shape = {1LL << 40, 1LL << 40};
  EXPECT_EQ(dd.RegisterKvCache(d, h.addrs, {}, id), LLM_PARAM_INVALID);
  EXPECT_EQ(id, -1);
  Cache c{};
  d.num_tensors = 1;
  d.shape = {1LL << 31, 1LL << 31};  // 2^62 bytes: refused before any allocation
  EXPECT_EQ(dd.AllocateCache(d, c), LLM_PARAM_INVALID);
}

TEST_F(Initialized, CopyKvCacheAndCopyKvBlocks) {
  HostCache a(2, {4, 8}), b(2, {4, 8}), odd(3, {4, 8}), small(2, {4, 4});
  ASSERT_EQ(a.Register(dd), LLM_SUCCESS);
  ASSERT_EQ(b.Register(dd), LLM_SUCCESS);
  ASSERT_EQ(odd.Register(dd), LLM_SUCCESS);
  ASSERT_EQ(small.Register(dd), LLM_SUCCESS);
  a.Fill(1);
  ASSERT_EQ(dd.CopyKvCache(a.cache, b.cache, 2, 1, 3, 4), LLM_SUCCESS);
  for (int t = 0; t < 2; ++t)
    for (int i = 0; i < 32; ++i) {
      uint8_t want = (i >= 8 + 3 && i < 8 + 7) ? a.T(t)[16 + 3 + (i - 8 - 3)] : 0;
      ASSERT_EQ(b.T(t)[i], want) << t << " " << i;
    }
  ASSERT_EQ(dd.CopyKvCache(a.cache, b.cache, 0, 3), LLM_SUCCESS);  // the whole slot
  EXPECT_EQ(std::memcmp(b.T(1) + 24, a.T(1), 8), 0);
  EXPECT_EQ(dd.CopyKvCache(a.cache, b.cache, 4, 0), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.CopyKvCache(a.cache, b.cache, 0, 4), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.CopyKvCache(a.cache, b.cache, 0, 0, 8), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.CopyKvCache(a.cache, b.cache, 0, 0, 4, 5), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.CopyKvCache(a.cache, b.cache, 0, 0, 0, 0), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.CopyKvCache(a.cache, odd.cache), LLM_PARAM_INVALID);
  Cache unknown{};
  unknown.cache_id = 77;
  EXPECT_EQ(dd.CopyKvCache(a.cache, unknown), LLM_KV_CACHE_NOT_EXIST);

  HostCache c(2, {4, 8});
  ASSERT_EQ(c.Register(dd), LLM_SUCCESS);
  ASSERT_EQ(dd.CopyKvBlocks(a.cache, c.cache, {0, 3}, {{1, 2}, {3, 0}}), LLM_SUCCESS);
  for (int t = 0; t < 2; ++t) {
    EXPECT_EQ(std::memcmp(c.T(t) + 8, a.T(t), 8), 0);
    EXPECT_EQ(std::memcmp(c.T(t) + 16, a.T(t) + 24, 8), 0);
    EXPECT_EQ(std::memcmp(c.T(t) + 24, a.T(t), 8), 0);
    EXPECT_EQ(std::memcmp(c.T(t), a.T(t) + 24, 8), 0);
  }
  EXPECT_EQ(dd.CopyKvBlocks(a.cache, c.cache, {4}, {{0}}), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.CopyKvBlocks(a.cache, c.cache, {0}, {{4}}), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.CopyKvBlocks(a.cache, c.cache, {0, 1}, {{0}}), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.CopyKvBlocks(a.cache, c.cache, {}, {}), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.CopyKvBlocks(a.cache, small.cache, {0}, {{0}}), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.CopyKvBlocks(a.cache, unknown, {0}, {{0}}), LLM_KV_CACHE_NOT_EXIST);
}

TEST_F(Initialized, LinkAndTransferArgumentErrors) {
  std::vector<Status> rets;
  EXPECT_EQ(dd.LinkLlmClusters({}, rets), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.LinkLlmClusters({ddtest::Cluster(2, 1)}, rets, 0), LLM_PARAM_INVALID);
  ClusterInfo no_ip{};
  no_ip.remote_cluster_id = 2;
  EXPECT_EQ(dd.LinkLlmClusters({no_ip}, rets), LLM_PARAM_INVALID);
  ClusterInfo bad_ip = ddtest::Cluster(2, 80);
  bad_ip.remote_ip_infos[0].ip = "localhost";  // IP literals only, checked before linking
  EXPECT_EQ(dd.LinkLlmClusters({bad_ip}, rets), LLM_PARAM_INVALID);
  for (const char *bad : {"[::1]", "::1::2", "fe80::1%lo", ":::"}) {  // an IPv6 ip is bare
    bad_ip.remote_ip_infos[0].ip = bad;
    EXPECT_EQ(dd.LinkLlmClusters({bad_ip}, rets), LLM_PARAM_INVALID) << bad;
    EXPECT_EQ(dd.UnlinkLlmClusters({bad_ip}, rets), LLM_PARAM_INVALID) << bad;
  }
  bad_ip = ddtest::Cluster(2, 80);
  bad_ip.local_ip_infos.push_back(IpInfo{});
  EXPECT_EQ(dd.LinkLlmClusters({bad_ip}, rets), LLM_PARAM_INVALID);
  // nobody listens there: LLM_LINK_FAILED per cluster, and as the overall code
  uint16_t dead = ddtest::FreePort();
  rets.clear();
  EXPECT_EQ(dd.LinkLlmClusters({ddtest::Cluster(2, dead)}, rets, 500), LLM_LINK_FAILED);
  ASSERT_EQ(rets.size(), 1U);
  EXPECT_EQ(rets[0], LLM_LINK_FAILED);
  // the reason, which the code cannot carry: kept per cluster
  std::string why = dd.LastLinkFailure(2).GetString();
  EXPECT_NE(why.find("cluster 2 at 127.0.0.1:" + std::to_string(dead)), std::string::npos) << why;
  EXPECT_NE(why.find("datadist probe"), std::string::npos) << why;
  EXPECT_STREQ(dd.LastLinkFailure(3).GetString(), "");
  EXPECT_EQ(dd.LinkLlmClusters({ddtest::Cluster(1, dead)}, rets, 500), LLM_LINK_FAILED);  // our own id
  // never linked: CANN dials the listener to tell it, and nobody answers there
  EXPECT_EQ(dd.UnlinkLlmClusters({ddtest::Cluster(2, dead)}, rets), LLM_UNLINK_FAILED);
  EXPECT_EQ(rets.back(), LLM_UNLINK_FAILED);
  EXPECT_EQ(dd.UnlinkLlmClusters({ddtest::Cluster(2, dead)}, rets, 1000, true),
            LLM_SUCCESS);  // forced: nothing to drop

  HostCache h(2, {4, 8});
  ASSERT_EQ(h.Register(dd), LLM_SUCCESS);
  EXPECT_EQ(dd.PullKvCache(ddtest::Index(2, 1), h.cache), LLM_NOT_YET_LINK);
  EXPECT_EQ(dd.PushKvBlocks(h.cache, ddtest::Index(2, 1), {0}, {0}), LLM_NOT_YET_LINK);
  EXPECT_EQ(dd.PullKvCache(ddtest::Index(1, 1), h.cache), LLM_PARAM_INVALID);  // own cluster
  // a remote cache id CANN looks up in the peer's table: without a link, the link is missing
  EXPECT_EQ(dd.PullKvCache(ddtest::Index(2, -3), h.cache), LLM_NOT_YET_LINK);
  EXPECT_EQ(dd.PushKvCache(h.cache, ddtest::Index(1, 1)), LLM_NOT_YET_LINK);  // no own-cluster rule for pushes
  EXPECT_EQ(dd.PullKvCache(ddtest::Index(2, 1), h.cache, 0, 0), LLM_PARAM_INVALID);
  // CANN's argument rules for blocks and pushes
  EXPECT_EQ(dd.PullKvBlocks(ddtest::Index(2, 1, 1), h.cache, {0}, {0}), LLM_PARAM_INVALID);
  // src_blocks and dst_blocks of different lengths, an empty dst_blocks too: CANN's
  // LLMDataDistV2::PullBlocks answers LLM_PARAM_INVALID (it has no blocks-into-a-cache pull)
  EXPECT_EQ(dd.PullKvBlocks(ddtest::Index(2, 1), h.cache, {0}, {}), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.PullKvBlocks(ddtest::Index(2, 1), h.cache, {0, 1}, {}), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.PushKvBlocks(h.cache, ddtest::Index(2, 1), {}, {0}), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.PushKvBlocks(h.cache, ddtest::Index(2, 1, 1), {0}, {0}), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.PushKvCache(h.cache, ddtest::Index(2, 1), 0, 5), LLM_PARAM_INVALID);
  // a push's two layer ranges must be as wide as each other, {-1, -1} (width 0) included:
  // CANN's PushKvCache / PushKvBlocks call CheckKvCacheExtParam(ext_param, true) first
  KvCacheExtParam all_to_two{};
  all_to_two.dst_layer_range = {0, 1};
  EXPECT_EQ(dd.PushKvCache(h.cache, ddtest::Index(2, 1), 0, -1, all_to_two), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.PushKvBlocks(h.cache, ddtest::Index(2, 1), {0}, {0}, all_to_two), LLM_PARAM_INVALID);
  KvCacheExtParam all_to_one{};
  all_to_one.dst_layer_range = {0, 0};  // same width: allowed, and then it needs a link
  EXPECT_EQ(dd.PushKvBlocks(h.cache, ddtest::Index(2, 1), {0}, {0}, all_to_one), LLM_NOT_YET_LINK);
  Cache unknown{};
  unknown.cache_id = 55;
  EXPECT_EQ(dd.PullKvCache(ddtest::Index(2, 1), unknown), LLM_KV_CACHE_NOT_EXIST);
  EXPECT_EQ(dd.PushKvCache(unknown, ddtest::Index(2, 1)), LLM_KV_CACHE_NOT_EXIST);
  EXPECT_EQ(dd.SetRole(static_cast<LlmRole>(0)), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.SetRole(LlmRole::kMix), LLM_SUCCESS);
}

}  // namespace

namespace {

// CANN's DataCacheEngine::CheckTensorIndices (hicann/hixl
// src/llm_datadist/cache_mgr/data_cache_engine.cc): a pull with layer ranges (both given:
// CalcIndicesWithValidRanges makes tensor indices only then) into a cache whose tensor count
// tensor_num_per_layer does not divide is LLM_PARAM_INVALID, before any link is looked up.
TEST_F(Initialized, LayerRangedPullsNeedWholeLayers) {
  HostCache odd(3, {4, 8});
  ASSERT_EQ(odd.Register(dd), LLM_SUCCESS);
  KvCacheExtParam layer0{};
  layer0.src_layer_range = {0, 0};
  layer0.dst_layer_range = {0, 0};
  layer0.tensor_num_per_layer = 2;
  EXPECT_EQ(dd.PullKvCache(ddtest::Index(2, 1), odd.cache, 0, -1, layer0), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.PullKvBlocks(ddtest::Index(2, 1), odd.cache, {0}, {0}, layer0), LLM_PARAM_INVALID);
  // one range alone names no tensors there (every tensor is pulled): no such rule
  KvCacheExtParam src_only{};
  src_only.src_layer_range = {0, 0};
  EXPECT_EQ(dd.PullKvCache(ddtest::Index(2, 1), odd.cache, 0, -1, src_only), LLM_NOT_YET_LINK);
  // one tensor per layer divides three: the pull goes as far as the missing link
  layer0.tensor_num_per_layer = 1;
  EXPECT_EQ(dd.PullKvCache(ddtest::Index(2, 1), odd.cache, 0, -1, layer0), LLM_NOT_YET_LINK);
  EXPECT_EQ(dd.PullKvBlocks(ddtest::Index(2, 1), odd.cache, {0}, {0}, layer0), LLM_NOT_YET_LINK);
}

// CANN's LlmDataDistImpl::PullKvCache / PullKvBlocks / PushKvCache / PushKvBlocks
// (hicann/hixl src/llm_datadist/llm_datadist.cc) call CheckKvCacheExtParam before the cache
// engine looks the local cache up: a bad layer range or tensor_num_per_layer 0 is
// LLM_PARAM_INVALID even for a cache id that does not exist (not LLM_KV_CACHE_NOT_EXIST).
TEST_F(Initialized, ExtParamIsCheckedBeforeTheLocalCache) {
  Cache unknown{};
  unknown.cache_id = 55;
  KvCacheExtParam bad_range{};
  bad_range.src_layer_range = {-2, 0};
  bad_range.dst_layer_range = {0, 1};
  KvCacheExtParam no_tensors{};
  no_tensors.tensor_num_per_layer = 0;
  for (const KvCacheExtParam &ext : {bad_range, no_tensors}) {
    EXPECT_EQ(dd.PullKvCache(ddtest::Index(2, 1), unknown, 0, -1, ext), LLM_PARAM_INVALID);
    EXPECT_EQ(dd.PullKvBlocks(ddtest::Index(2, 1), unknown, {0}, {0}, ext), LLM_PARAM_INVALID);
    EXPECT_EQ(dd.PushKvCache(unknown, ddtest::Index(2, 1), 0, -1, ext), LLM_PARAM_INVALID);
    EXPECT_EQ(dd.PushKvBlocks(unknown, ddtest::Index(2, 1), {0}, {0}, ext), LLM_PARAM_INVALID);
  }
  // a push's ranges of different widths, {-1, -1} against {0, 1}
  KvCacheExtParam widths{};
  widths.dst_layer_range = {0, 1};
  EXPECT_EQ(dd.PushKvCache(unknown, ddtest::Index(2, 1), 0, -1, widths), LLM_PARAM_INVALID);
  // valid arguments: now the cache is looked up
  EXPECT_EQ(dd.PullKvCache(ddtest::Index(2, 1), unknown), LLM_KV_CACHE_NOT_EXIST);
  EXPECT_EQ(dd.PushKvCache(unknown, ddtest::Index(2, 1)), LLM_KV_CACHE_NOT_EXIST);
}

}  // namespace

namespace {

// CANN's HIXL engine parses OPTION_GLOBAL_RESOURCE_CONFIG at Initialize (hicann/hixl
// src/hixl/engine/hixl_options.cc, HixlOptions::ParseGlobalResourceConfig): a value that is
// not JSON, or not an object, fails it. Without the HIXL backend the option is not read.
TEST(Api, HixlGlobalResourceConfigMustBeAJsonObject) {
  for (const char *bad : {"not json", "{", "[1, 2]", "\"text\"", "12", "{\"a\": }", "{\"a\": 1,}", "{'a': 1}",
                          "{\"a\": 01}", "{\"a\": 1} x", "NaN", "{\"a\": \"\\q\"}"}) {
    LlmDataDist dd(1, LlmRole::kPrompt);
    auto o = ddtest::Options();
    o[OPTION_TRANSFER_BACKEND] = "hixl";
    o[OPTION_GLOBAL_RESOURCE_CONFIG] = bad;
    EXPECT_EQ(dd.Initialize(o), LLM_PARAM_INVALID) << bad;
  }
  for (const char *good :
       {"", "{}",
        " { \"connect_pool.thread_num\" : \"4\", \"x\": [1, -2.5e3, true, null, {\"y\": \"\\u00e9\\n\"}] } "}) {
    LlmDataDist dd(1, LlmRole::kPrompt);
    auto o = ddtest::Options();
    o[OPTION_TRANSFER_BACKEND] = "hixl";
    o[OPTION_GLOBAL_RESOURCE_CONFIG] = good;
    EXPECT_EQ(dd.Initialize(o), LLM_SUCCESS) << good;
  }
  LlmDataDist plain(1, LlmRole::kPrompt);
  auto o = ddtest::Options();
  o[OPTION_GLOBAL_RESOURCE_CONFIG] = "not json";
  EXPECT_EQ(plain.Initialize(o), LLM_SUCCESS);
}

// ---- issue 38: what a C++ caller is told (items 1, 4, 15) ----

// Collects what SetLogCallback delivers, for one test; unset again when it ends.
struct LogCapture {
  LogCapture() { SetLogCallback(&LogCapture::On, this); }
  ~LogCapture() { SetLogCallback(nullptr); }
  static void On(LogLevel level, const char *message, void *self) {
    auto *c = static_cast<LogCapture *>(self);
    std::lock_guard<std::mutex> lock(c->mu);
    c->lines.emplace_back(level, message);
  }
  std::vector<std::pair<LogLevel, std::string>> Of(LogLevel level) {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<std::pair<LogLevel, std::string>> out;
    for (const auto &l : lines)
      if (l.first == level) out.push_back(l);
    return out;
  }
  std::mutex mu;
  std::vector<std::pair<LogLevel, std::string>> lines;
};

bool Has(const std::string &text, const std::string &part) { return text.find(part) != std::string::npos; }

TEST(Api, LastErrorMessageSaysWhyInTheCppApisWords) {
  LogCapture log;
  LlmDataDist dd(1, LlmRole::kDecoder);
  std::vector<Status> rets;
  EXPECT_EQ(dd.LinkLlmClusters({ddtest::Cluster(2, 1)}, rets), LLM_FAILED);
  std::string why = GetLastErrorMessage();
  EXPECT_TRUE(Has(why, "LinkLlmClusters failed (LLM_FAILED, 0xFFFFFFFF): not initialized")) << why;
  ASSERT_EQ(dd.Initialize(ddtest::Options()), LLM_SUCCESS);
  EXPECT_STREQ(GetLastErrorMessage(), "");  // a success clears it
  // nobody listens there: the core's hint names the C++ option, not LLMConfig.listen_ip_info
  const uint16_t dead = ddtest::FreePort();
  EXPECT_EQ(dd.LinkLlmClusters({ddtest::Cluster(2, dead)}, rets, 500), LLM_LINK_FAILED);
  why = GetLastErrorMessage();
  EXPECT_TRUE(Has(why, "LinkLlmClusters failed (LLM_LINK_FAILED, 0x5010B009): cluster 2 (LLM_LINK_FAILED): ")) << why;
  EXPECT_TRUE(Has(why, "llm.ListenIpInfo (OPTION_LISTEN_IP_INFO)")) << why;
  EXPECT_FALSE(Has(why, "LLMConfig")) << why;
  EXPECT_FALSE(Has(why, "listen_ip_info")) << why;
  const std::string last = dd.LastLinkFailure(2).GetString();  // the same words there
  EXPECT_TRUE(Has(last, "llm.ListenIpInfo (OPTION_LISTEN_IP_INFO)")) << last;
  // the same text reached the log callback, as an error
  auto errors = log.Of(LogLevel::kError);
  ASSERT_FALSE(errors.empty());
  EXPECT_EQ(errors.back().second, why);
  // per thread: another thread's calls leave this one's message alone
  std::thread([&] {
    EXPECT_STREQ(GetLastErrorMessage(), "");
    std::vector<Status> none;
    EXPECT_EQ(dd.LinkLlmClusters({}, none), LLM_PARAM_INVALID);
    EXPECT_TRUE(Has(GetLastErrorMessage(), "LinkLlmClusters failed (LLM_PARAM_INVALID, 0x5010B005): "))
        << GetLastErrorMessage();
  }).join();
  EXPECT_EQ(GetLastErrorMessage(), why);
}

TEST(Api, SizesInMessagesAreReadable) {
  // A pull larger than the slot: the byte count, and KiB beside it.
  const uint16_t port = ddtest::FreePort();
  LlmDataDist prompt(10, LlmRole::kPrompt);
  ASSERT_EQ(prompt.Initialize(ddtest::Options(port)), LLM_SUCCESS);
  HostCache remote(1, {4, 2048});
  ASSERT_EQ(remote.Register(prompt), LLM_SUCCESS);
  LlmDataDist dd(20, LlmRole::kDecoder);
  ASSERT_EQ(dd.Initialize(ddtest::Options()), LLM_SUCCESS);
  std::vector<Status> rets;
  ASSERT_EQ(dd.LinkLlmClusters({ddtest::Cluster(10, port)}, rets), LLM_SUCCESS);
  HostCache local(1, {4, 2048});
  ASSERT_EQ(local.Register(dd), LLM_SUCCESS);
  EXPECT_EQ(dd.PullKvCache(ddtest::Index(10, remote.cache.cache_id), local.cache, 0, 4096), LLM_PARAM_INVALID);
  const std::string why = GetLastErrorMessage();
  EXPECT_TRUE(Has(why, "PullKvCache failed (LLM_PARAM_INVALID, 0x5010B005): ")) << why;
  EXPECT_TRUE(Has(why, "2048 bytes (2 KiB)")) << why;
}

// CANN's LinkMsgHandler files a link under the cluster id the peer answers and never compares
// it with remote_cluster_id (hicann/hixl src/llm_datadist/link_mgr/link_msg_handler.cc,
// ExchangeInfoProcess): the link succeeds; datadist says so, naming both ids.
TEST(Api, AWrongClusterIdLinksWithAWarningNamingBothIds) {
  LogCapture log;
  const uint16_t port = ddtest::FreePort();
  LlmDataDist prompt(10, LlmRole::kPrompt);
  ASSERT_EQ(prompt.Initialize(ddtest::Options(port)), LLM_SUCCESS);
  HostCache remote(1, {4, 8});
  ASSERT_EQ(remote.Register(prompt), LLM_SUCCESS);
  LlmDataDist dd(20, LlmRole::kDecoder);
  ASSERT_EQ(dd.Initialize(ddtest::Options()), LLM_SUCCESS);
  std::vector<Status> rets;
  ASSERT_EQ(dd.LinkLlmClusters({ddtest::Cluster(99, port)}, rets), LLM_SUCCESS);
  EXPECT_EQ(rets, std::vector<Status>{LLM_SUCCESS});
  auto warnings = log.Of(LogLevel::kWarning);
  ASSERT_EQ(warnings.size(), 1U);
  EXPECT_TRUE(Has(warnings[0].second, "answered as cluster 10, not the remote_cluster_id 99")) << warnings[0].second;
  HostCache local(1, {4, 8});
  ASSERT_EQ(local.Register(dd), LLM_SUCCESS);
  EXPECT_EQ(dd.PullKvCache(ddtest::Index(99, remote.cache.cache_id), local.cache), LLM_NOT_YET_LINK);
  EXPECT_EQ(dd.PullKvCache(ddtest::Index(10, remote.cache.cache_id), local.cache), LLM_SUCCESS);
  // the right id: no warning
  EXPECT_EQ(dd.UnlinkLlmClusters({ddtest::Cluster(10, port)}, rets), LLM_SUCCESS);
  ASSERT_EQ(dd.LinkLlmClusters({ddtest::Cluster(10, port)}, rets), LLM_SUCCESS);
  EXPECT_EQ(log.Of(LogLevel::kWarning).size(), 1U);
}

// hicann/hixl tests/cpp/llm_datadist/llm_datadist_v2_api_unittest.cc, TestLocalCommResInvalidJson
// and TestLocalCommResInvalidVersion: Initialize accepts a bad llm.LocalCommRes; linking fails
// (RankTableGeneratorFactory::Create, LLM_PARAM_INVALID on both ends), whichever end has it.
std::string CommRes(const char *device_id, const char *device_ip, const char *version, bool broken = false) {
  return std::string(R"({"server_count": "1", "server_list": [{"device": [{"device_id": ")") + device_id +
         (broken ? "\",xxxxxxxxxxxxxxx" : "\",") + R"( "device_ip": ")" + device_ip +
         R"("}], "server_id": "127.0.0.1"}], "status": "completed", "version": ")" + version + "\"}";
}

void ExpectLinkWithCommRes(const std::string &prompt_res, const std::string &decoder_res, Status want,
                           const char *why_part) {
  const uint16_t port = ddtest::FreePort();
  LlmDataDist prompt(1, LlmRole::kPrompt);
  auto po = ddtest::Options(port);
  po[OPTION_LOCAL_COMM_RES] = prompt_res.c_str();
  ASSERT_EQ(prompt.Initialize(po), LLM_SUCCESS);  // accepted, as CANN
  LlmDataDist decoder(2, LlmRole::kDecoder);
  auto d = ddtest::Options();
  d[OPTION_DEVICE_ID] = "1";
  d[OPTION_LOCAL_COMM_RES] = decoder_res.c_str();
  ASSERT_EQ(decoder.Initialize(d), LLM_SUCCESS);
  ClusterInfo c = ddtest::Cluster(0, port);  // as the original's test: remote_cluster_id left 0
  c.local_ip_infos = c.remote_ip_infos;
  std::vector<Status> rets;
  EXPECT_EQ(decoder.LinkLlmClusters({c}, rets), want);
  EXPECT_EQ(rets, std::vector<Status>{want});
  if (why_part != nullptr) {
    EXPECT_TRUE(Has(GetLastErrorMessage(), why_part)) << GetLastErrorMessage();
  }
}

TEST(Api, LocalCommResIsCheckedWhenLinkingAsCann) {
  const std::string good_p = CommRes("0", "1.1.1.1", "1.0"), good_d = CommRes("1", "1.1.1.2", "1.0");
  // the original's two tests: the PROMPT's text is bad, the DECODER's good
  ExpectLinkWithCommRes(CommRes("0", "1.1.1.1", "1.0", true), good_d, LLM_PARAM_INVALID,
                        "the llm.LocalCommRes of cluster 1 (the peer) is not valid: it is not JSON");
  ExpectLinkWithCommRes(CommRes("0", "1.1.1.1", "1.9"), good_d, LLM_PARAM_INVALID,
                        "its version \"1.9\" is not one CANN knows");
  // the linker's own text is bad
  ExpectLinkWithCommRes(good_p, CommRes("1", "1.1.1.2", "2.0"), LLM_PARAM_INVALID,
                        "our llm.LocalCommRes is not valid: its version \"2.0\"");
  ExpectLinkWithCommRes(good_p, "{\"server_count\": \"1\"}", LLM_PARAM_INVALID, "it has no \"version\"");
  // good ones link, 1.2 too, and so does an empty one (CANN generates one then)
  ExpectLinkWithCommRes(good_p, good_d, LLM_SUCCESS, nullptr);
  ExpectLinkWithCommRes(CommRes("0", "1.1.1.1", "1.2"), "", LLM_SUCCESS, nullptr);
  // With llm.TransferBackend = "hixl" the value is HIXL's endpoint list (version "1.3", hixl's
  // EndpointGenerator), not a rank table: not checked.
  const uint16_t port = ddtest::FreePort();
  LlmDataDist prompt(1, LlmRole::kPrompt);
  ASSERT_EQ(prompt.Initialize(ddtest::Options(port)), LLM_SUCCESS);
  LlmDataDist decoder(2, LlmRole::kDecoder);
  auto d = ddtest::Options(ddtest::FreePort());
  d[OPTION_TRANSFER_BACKEND] = "hixl";
  d[OPTION_LOCAL_COMM_RES] = R"({"endpoint_list": [], "version": "1.3"})";
  ASSERT_EQ(decoder.Initialize(d), LLM_SUCCESS);
  std::vector<Status> rets;
  EXPECT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(1, port)}, rets), LLM_SUCCESS) << GetLastErrorMessage();
}

}  // namespace

// The session's rules as the C++ API shows them (cpp/src/session.h; session_test.cc tests
// the session itself, a thread that cannot start included: the library's copy of the core
// cannot be reached from here).
namespace {

// Failed pulls with `code_name` counted in the process's metrics, over every series.
uint64_t PullErrors(LlmDataDist &dd, const std::string &code_name) {
  std::vector<TransferMetrics> all;
  EXPECT_EQ(dd.GetMetrics(all), LLM_SUCCESS);
  uint64_t n = 0;
  for (const auto &m : all) {
    if (m.op != "pull") continue;
    auto it = m.errors.find(code_name);
    if (it != m.errors.end()) n += it->second;
  }
  return n;
}

}  // namespace

// Runs of blocks are coalesced for the copy; within one cache a block may not be both read
// and written (the planner's rule, Python's copy_blocks' too: docs/compatibility.md), so a run
// shifted onto itself is refused and nothing is written.
TEST_F(Initialized, CopyKvBlocksCoalescesRunsAndRefusesABlockBothReadAndWritten) {
  HostCache a(2, {8, 4}), b(2, {8, 4});
  ASSERT_EQ(a.Register(dd), LLM_SUCCESS);
  ASSERT_EQ(b.Register(dd), LLM_SUCCESS);
  for (int t = 0; t < 2; ++t)
    for (int i = 0; i < 32; ++i) a.T(t)[i] = static_cast<uint8_t>(t * 50 + i / 4 + 1);
  ASSERT_EQ(dd.CopyKvBlocks(a.cache, a.cache, {0, 1, 2}, {{1, 2, 3}}), LLM_PARAM_INVALID);
  for (int t = 0; t < 2; ++t)
    for (int blk = 0; blk < 4; ++blk) EXPECT_EQ(a.T(t)[blk * 4 + 3], t * 50 + blk + 1) << t << " " << blk;
  ASSERT_EQ(dd.CopyKvBlocks(a.cache, a.cache, {0, 1}, {{6, 7}}), LLM_SUCCESS);  // a run within one cache
  for (int t = 0; t < 2; ++t) EXPECT_EQ(std::memcmp(a.T(t) + 24, a.T(t), 8), 0);
  EXPECT_EQ(a.T(1)[4 * 4], 50 + 5);  // untouched
  // two runs into another cache, and a second destination list
  ASSERT_EQ(dd.CopyKvBlocks(a.cache, b.cache, {4, 5, 7}, {{0, 1, 6}, {2, 3, 4}}), LLM_SUCCESS);
  for (int t = 0; t < 2; ++t) {
    EXPECT_EQ(std::memcmp(b.T(t), a.T(t) + 16, 8), 0);
    EXPECT_EQ(std::memcmp(b.T(t) + 24, a.T(t) + 28, 4), 0);
    EXPECT_EQ(std::memcmp(b.T(t) + 8, a.T(t) + 16, 8), 0);
    EXPECT_EQ(std::memcmp(b.T(t) + 16, a.T(t) + 28, 4), 0);
    EXPECT_EQ(b.T(t)[20], 0);
  }
}

// More spans than an owner serves in one request (tensors x block runs over 4194304):
// refused before anything is sent, and counted as a failed pull as Python's are.
TEST_F(Initialized, APullOverTheRequestCapIsRefusedAndCounted) {
  HostCache big(1024, {8194, 1});
  ASSERT_EQ(big.Register(dd), LLM_SUCCESS);
  std::vector<uint64_t> every_other;
  for (uint64_t b = 0; b < 8194; b += 2) every_other.push_back(b);  // 4097 runs of one block
  const uint64_t before = PullErrors(dd, "LLM_PARAM_INVALID");
  EXPECT_EQ(dd.PullKvBlocks(ddtest::Index(5, 1), big.cache, every_other, every_other), LLM_PARAM_INVALID);
  EXPECT_NE(std::string(GetLastErrorMessage()).find("spans"), std::string::npos) << GetLastErrorMessage();
  EXPECT_EQ(PullErrors(dd, "LLM_PARAM_INVALID"), before + 1);
}

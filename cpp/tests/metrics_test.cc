// Transfer metrics in the core (src/metrics.h) and through the C++ API (GetMetrics,
// GetPeerMetrics, ResetMetrics): the counters the Python API reports, with its names and
// units, on both sides of a link, and the STATS answer in the JSON the Python API reads.
#include "metrics.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

namespace {

using namespace llm_datadist;
using ddtest::HostCache;
using ddtest::Index;
namespace metrics = datadist::metrics;

// The core's own table (this test binary's copy of datadist_core; the API's is in the .so).
TEST(MetricsCore, StatsAnswerIsThePythonOwnersJson) {
  metrics::Reset();
  ASSERT_TRUE(metrics::Admit(5));  // linked: its series is its own (a peer's handshake does this)
  metrics::Record(metrics::Op::kServeRead, 5, 100, std::chrono::microseconds(5), LLM_SUCCESS);
  metrics::Record(metrics::Op::kServeRead, 5, 77, std::chrono::milliseconds(1), LLM_KV_CACHE_NOT_EXIST);
  metrics::Record(metrics::Op::kPull, 6, 7, std::chrono::seconds(2), LLM_SUCCESS);
  // What Python's json.dumps(Engine.stats(peer 5), separators=(",", ":")) gives for the same
  // three records (made with datadist.core.metrics.Metrics): byte for byte.
  const std::string series =
      R"({"serve_read":{"transfers":2,"bytes":100,"errors":{"LLM_KV_CACHE_NOT_EXIST":1},"seconds":0.001005,)"
      R"("latency_buckets":{"1e-05":1,"2.5e-05":1,"5e-05":1,"0.0001":1,"0.00025":1,"0.0005":1,"0.001":2,)"
      R"("0.0025":2,"0.005":2,"0.01":2,"0.025":2,"0.05":2,"0.1":2,"0.25":2,"0.5":2,"1.0":2,"2.5":2,"5.0":2,)"
      R"("10.0":2,"25.0":2,"50.0":2,"100.0":2},"p50_s":1e-05,"p99_s":0.001}})";
  EXPECT_EQ(metrics::StatsJson(9, 1, 5, true),
            R"({"cluster_id":9,"role":1,"total":)" + series + R"(,"links":{"5":)" + series + "}}");
  // Another peer's series are never told; nor any to a connection that is not the peer's.
  EXPECT_EQ(metrics::StatsJson(9, 1, 7, true), R"({"cluster_id":9,"role":1,"total":{},"links":{}})");
  EXPECT_EQ(metrics::StatsJson(9, 1, 5, false), R"({"cluster_id":9,"role":1,"total":{},"links":{}})");
  metrics::Reset();
  EXPECT_TRUE(metrics::Snapshot().empty());
}

TEST(MetricsCore, BucketsQuantilesAndStatusNamesAsPython) {
  metrics::Reset();
  // Python's test_series_arithmetic, in the core: 5 us, 300 us twice, 2 ms, 500 s, and one
  // LLM_TIMEOUT after 100 ms.
  for (auto us : {5LL, 300LL, 300LL, 2000LL, 500000000LL})
    metrics::Record(metrics::Op::kPush, 9, 100, std::chrono::microseconds(us), LLM_SUCCESS);
  metrics::Record(metrics::Op::kPush, 9, 100, std::chrono::milliseconds(100), LLM_TIMEOUT);
  const std::vector<metrics::Series> all = metrics::Snapshot();
  ASSERT_EQ(all.size(), 1U);
  const metrics::Series &s = all[0];
  EXPECT_EQ(s.transfers, 6U);
  EXPECT_EQ(s.bytes, 500U);
  ASSERT_EQ(s.errors.size(), 1U);
  EXPECT_EQ(s.errors[0].first, "LLM_TIMEOUT");
  EXPECT_EQ(s.counts[0], 1U);                  // 5 us <= 10 us
  EXPECT_EQ(s.counts[metrics::kBuckets], 1U);  // 500 s lies above every bucket
  EXPECT_EQ(s.Quantile(0.5), 5e-4);
  EXPECT_TRUE(std::isinf(s.Quantile(0.99)));
  EXPECT_STREQ(metrics::StatusName(0x5010B011U), "LLM_SEQ_LENOVERLIMIT");  // llm_datadist's spelling
  EXPECT_STREQ(metrics::StatusName(0x12345U), "LLM_FAILED");               // anything else, as Python counts it
  metrics::Reset();
}

TEST(MetricsCore, ManyThreadsAndManyPeersLoseNoCount) {
  metrics::Reset();
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([t] {
      for (uint64_t i = 0; i < 2000; ++i)  // 1000 peers: the table grows past its first segment
        metrics::Record(metrics::Op::kPull, i % 1000, 1, std::chrono::microseconds(t), LLM_SUCCESS);
    });
  for (auto &th : threads) th.join();
  const std::vector<metrics::Series> all = metrics::Snapshot();
  ASSERT_EQ(all.size(), 1000U);
  for (const metrics::Series &s : all) {
    EXPECT_EQ(s.transfers, 16U) << s.cluster_id;
    EXPECT_EQ(s.bytes, 16U) << s.cluster_id;
  }
  metrics::Reset();
}

// Issue 35, item 3: ids that strangers claim cannot grow the table. Before the cap, 5,000
// claimed ids made 5,000 series per operation and each STATS copied all of them.
TEST(MetricsCore, ClaimedIdsFoldIntoOneSeriesPastTheCapAndStatsDoesNotScale) {
  metrics::Reset();
  constexpr uint64_t kAsker = 7'000'000;  // a linked peer that asks for its STATS
  ASSERT_TRUE(metrics::Admit(kAsker));
  for (size_t op = 0; op < metrics::kOps; ++op)
    metrics::Record(static_cast<metrics::Op>(op), kAsker, 10, std::chrono::microseconds(3), LLM_SUCCESS);
  // One STATS answer's cost, the best of a few rounds (a loaded host only slows some).
  auto stats_ns = [&] {
    double best = 1e18;
    for (int round = 0; round < 5; ++round) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 200; ++i)
        EXPECT_NE(metrics::StatsJson(1, 1, kAsker, true).find("serve_lease"), std::string::npos);
      best =
          std::min(best, std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / 200);
    }
    return best;
  };
  const double before = stats_ns();
  // 5,000 distinct ids: served requests of strangers whose handshake named them (up to the
  // cap), of ids never named, and our own pulls (which name their link's id).
  const uint64_t first = 1'000'000;
  for (uint64_t i = 0; i < 5000; ++i) {
    const uint64_t id = first + i;
    if (i % 2 == 0) metrics::Admit(id);  // its control channel completed the handshake
    for (size_t op = 0; op < metrics::kOps; ++op)
      metrics::Record(static_cast<metrics::Op>(op), id, 1, std::chrono::microseconds(1), LLM_KV_CACHE_NOT_EXIST);
  }
  EXPECT_EQ(metrics::NamedCount(), metrics::kMaxNamedPeers);
  // The bound: (cap + 1) x operations series, whatever was claimed.
  EXPECT_LE(metrics::CellCount(), (metrics::kMaxNamedPeers + 1) * metrics::kOps);
  const std::vector<metrics::Series> all = metrics::Snapshot();
  EXPECT_LE(all.size(), (metrics::kMaxNamedPeers + 1) * metrics::kOps);
  uint64_t transfers = 0, other = 0;
  for (const metrics::Series &s : all) {
    transfers += s.transfers;
    if (s.cluster_id == metrics::kOtherPeers)
      other += s.transfers;
    else
      EXPECT_TRUE(metrics::IsNamed(s.cluster_id)) << s.cluster_id;
  }
  EXPECT_EQ(transfers, 5001U * metrics::kOps);  // nothing lost: folded, not dropped
  EXPECT_GE(other, 2500U * 3);                  // at least the never-named ids' serve_read, serve_write, serve_lease
  // A peer whose id is not named (the last ones: past the cap) is told nothing (the folded
  // series is nobody's own).
  const uint64_t unnamed = first + 4999;
  ASSERT_FALSE(metrics::IsNamed(unnamed));
  EXPECT_EQ(metrics::StatsJson(1, 1, unnamed, true), R"({"cluster_id":1,"role":1,"total":{},"links":{}})");
  // STATS looks up the asker's cells: its cost does not grow with the table (it copied
  // the whole table before: hundreds of times slower here).
  const double after = stats_ns();
  EXPECT_LT(after, 5 * before + 20000) << "ns per STATS answer: " << before << " before, " << after << " after";
  metrics::Reset();
}

constexpr uint64_t kPrompt = 3;
constexpr uint64_t kDecoder = 4;

const TransferMetrics *Find(const std::vector<TransferMetrics> &all, const std::string &op, uint64_t cluster) {
  for (const TransferMetrics &m : all)
    if (m.op == op && m.cluster_id == cluster) return &m;
  return nullptr;
}

TEST(MetricsApi, BothSidesCountAndThePeerTellsItsOwnSeries) {
  LlmDataDist::ResetMetrics();
  const uint16_t port = ddtest::FreePort();
  HostCache src{4, {4, 16}};  // outlives the instances
  HostCache dst{4, {4, 16}};
  LlmDataDist prompt{kPrompt, LlmRole::kPrompt};
  LlmDataDist decoder{kDecoder, LlmRole::kDecoder};
  ASSERT_EQ(prompt.Initialize(ddtest::Options(port)), LLM_SUCCESS);
  auto options = ddtest::Options(0, "2000");
  options["datadist.Transport"] = "tcp";  // requests, not same-host leases: the owner sees each
  ASSERT_EQ(decoder.Initialize(options), LLM_SUCCESS);
  ASSERT_EQ(src.Register(prompt), LLM_SUCCESS);
  ASSERT_EQ(dst.Register(decoder), LLM_SUCCESS);
  std::string json;
  EXPECT_EQ(decoder.GetPeerMetrics(kPrompt, json), LLM_NOT_YET_LINK);
  std::vector<Status> rets;
  ASSERT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 3000), LLM_SUCCESS);

  for (uint32_t slot = 0; slot < 3; ++slot)
    ASSERT_EQ(decoder.PullKvCache(Index(kPrompt, 1, slot), dst.cache, slot), LLM_SUCCESS);
  EXPECT_EQ(decoder.PullKvCache(Index(kPrompt, 9), dst.cache), LLM_KV_CACHE_NOT_EXIST);
  ASSERT_EQ(decoder.PushKvCache(dst.cache, Index(kPrompt, 1, 3)), LLM_SUCCESS);

  std::vector<TransferMetrics> all;
  ASSERT_EQ(decoder.GetMetrics(all), LLM_SUCCESS);
  const TransferMetrics *pull = Find(all, "pull", kPrompt);
  ASSERT_NE(pull, nullptr);
  EXPECT_EQ(pull->transfers, 4U);
  EXPECT_EQ(pull->bytes, 3U * 4 * 16);  // a slot of 16 bytes in each of 4 tensors, successes only
  EXPECT_EQ(pull->errors, (std::map<std::string, uint64_t>{{"LLM_KV_CACHE_NOT_EXIST", 1}}));
  ASSERT_EQ(pull->latency_buckets.size(), 22U);
  EXPECT_EQ(pull->latency_buckets.front().first, 1e-5);
  EXPECT_EQ(pull->latency_buckets.back(), std::make_pair(100.0, uint64_t{4}));  // cumulative
  EXPECT_GT(pull->seconds, 0.0);
  const TransferMetrics *push = Find(all, "push", kPrompt);
  ASSERT_NE(push, nullptr);
  EXPECT_EQ(push->transfers, 1U);
  EXPECT_EQ(push->bytes, 4U * 16);
  // The owner's side of the same link (both instances count in this process's metrics).
  const TransferMetrics *served = Find(all, "serve_read", kDecoder);
  ASSERT_NE(served, nullptr);
  EXPECT_EQ(served->transfers, 4U);
  EXPECT_EQ(served->bytes, 3U * 4 * 16);
  EXPECT_EQ(served->errors, pull->errors);  // the refusal, with its code
  const TransferMetrics *written = Find(all, "serve_write", kDecoder);
  ASSERT_NE(written, nullptr);
  EXPECT_EQ(written->transfers, 1U);
  EXPECT_EQ(written->bytes, 4U * 16);

  // STATS over the link: the prompt tells the decoder what it did for the decoder, nothing else.
  ASSERT_EQ(decoder.GetPeerMetrics(kPrompt, json), LLM_SUCCESS);
  EXPECT_EQ(json.rfind(R"({"cluster_id":3,"role":1,"total":{)", 0), 0U) << json;
  EXPECT_NE(json.find(R"("links":{"4":{)"), std::string::npos) << json;
  EXPECT_NE(json.find(R"("serve_read":{"transfers":4,"bytes":192,"errors":{"LLM_KV_CACHE_NOT_EXIST":1})"),
            std::string::npos)
      << json;
  EXPECT_NE(json.find(R"("serve_write":{"transfers":1,"bytes":64,)"), std::string::npos) << json;
  EXPECT_EQ(json.find("\"pull\""), std::string::npos) << json;  // the decoder's own series are not the prompt's
  EXPECT_EQ(decoder.GetPeerMetrics(kPrompt, json, 0), LLM_PARAM_INVALID);

  LlmDataDist::ResetMetrics();
  ASSERT_EQ(decoder.GetMetrics(all), LLM_SUCCESS);
  EXPECT_TRUE(all.empty());
  decoder.Finalize();
  prompt.Finalize();
}

TEST(MetricsApi, SameHostReadsUnderALeaseAreTheReadersToCount) {
  LlmDataDist::ResetMetrics();
  const uint16_t port = ddtest::FreePort();
  HostCache src{2, {4, 16}};
  HostCache dst{2, {4, 16}};
  LlmDataDist prompt{kPrompt, LlmRole::kPrompt};
  LlmDataDist decoder{kDecoder, LlmRole::kDecoder};
  ASSERT_EQ(prompt.Initialize(ddtest::Options(port)), LLM_SUCCESS);
  ASSERT_EQ(decoder.Initialize(ddtest::Options(0, "2000")), LLM_SUCCESS);  // the local channel
  ASSERT_EQ(src.Register(prompt), LLM_SUCCESS);
  ASSERT_EQ(dst.Register(decoder), LLM_SUCCESS);
  std::vector<Status> rets;
  ASSERT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(kPrompt, port)}, rets, 3000), LLM_SUCCESS);
  for (uint32_t slot = 0; slot < 3; ++slot)
    ASSERT_EQ(decoder.PullKvCache(Index(kPrompt, 1, slot), dst.cache, slot), LLM_SUCCESS);
  std::vector<TransferMetrics> all;
  ASSERT_EQ(decoder.GetMetrics(all), LLM_SUCCESS);
  const TransferMetrics *pull = Find(all, "pull", kPrompt);
  ASSERT_NE(pull, nullptr);
  EXPECT_EQ(pull->transfers, 3U);
  EXPECT_EQ(pull->bytes, 3U * 2 * 16);
  const TransferMetrics *lease = Find(all, "serve_lease", kDecoder);
  ASSERT_NE(lease, nullptr) << "the pulls did not go under a lease";
  EXPECT_EQ(lease->transfers, 1U);  // one lease for the three pulls
  EXPECT_EQ(lease->bytes, 0U);
  EXPECT_EQ(Find(all, "serve_read", kDecoder), nullptr);  // the owner never saw the reads
  LlmDataDist::ResetMetrics();
  decoder.Finalize();
  prompt.Finalize();
}

}  // namespace

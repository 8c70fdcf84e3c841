// A small benchmark of the C++ pull over loopback TCP (two instances in one process):
// p50 latency of a 16-byte and a 16 KiB PullKvCache, and GB/s of PullKvBlocks over a large
// cache. Not run by ctest:  build/cpp/dd_bench [MiB]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "test_util.h"

using namespace llm_datadist;
using Clock = std::chrono::steady_clock;
using ddtest::HostCache;

namespace {

double P50Micros(LlmDataDist &d, HostCache &dst, int64_t remote, int reps) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    if (d.PullKvCache(ddtest::Index(1, remote, 0), dst.cache, 0) != LLM_SUCCESS) std::exit(1);
    t.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char **argv) {
  const int64_t mib = argc > 1 ? std::atoi(argv[1]) : 256;
  uint16_t port = ddtest::FreePort();
  HostCache tiny_src(1, {1, 16}), tiny_dst(1, {1, 16});
  HostCache small_src(1, {1, 16384}), small_dst(1, {1, 16384});
  const int64_t blocks = mib * 16;  // 64 KiB blocks, 4 tensors
  HostCache big_src(4, {blocks / 4, 65536}), big_dst(4, {blocks / 4, 65536});
  LlmDataDist p(1, LlmRole::kPrompt), d(2, LlmRole::kDecoder);
  if (p.Initialize(ddtest::Options(port, "60000")) || d.Initialize(ddtest::Options(0, "60000"))) return 1;
  for (HostCache *c : {&tiny_src, &small_src, &big_src}) c->Register(p);
  for (HostCache *c : {&tiny_dst, &small_dst, &big_dst}) c->Register(d);
  big_src.Fill(1);
  std::vector<Status> rets;
  if (d.LinkLlmClusters({ddtest::Cluster(1, port)}, rets, 3000)) return 1;
  P50Micros(d, tiny_dst, 1, 200);  // warm up
  double tiny = P50Micros(d, tiny_dst, 1, 2000);
  double small = P50Micros(d, small_dst, 2, 2000);
  std::vector<uint64_t> all;
  for (int64_t b = 0; b < blocks / 4; ++b) all.push_back(static_cast<uint64_t>(b));
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = Clock::now();
    if (d.PullKvBlocks(ddtest::Index(1, 3), big_dst.cache, all, all) != LLM_SUCCESS) return 1;
    double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, static_cast<double>(mib) * (1 << 20) / s / 1e9);
  }
  std::printf("pull 16 B p50 %.1f us | pull 16 KiB p50 %.1f us (%.2fx) | PullKvBlocks %ld MiB: %.2f GB/s\n", tiny,
              small, small / tiny, static_cast<long>(mib), best);
  return 0;
}

// The checksum's speed (crc32.h) beside memcpy's over the same bytes, in one run: what a
// checksummed pull adds per side (each side reads its spans once more). Not run by ctest.
//
//   dd_crc_bench [MiB] [repeat]     (defaults: 64 MiB, 5 repetitions; the best of them)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "crc32.h"

namespace {

template <typename F>
double BestGBs(size_t bytes, int repeat, F &&f) {
  double best = 0;
  for (int r = 0; r < repeat; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0 && bytes / s / 1e9 > best) best = bytes / s / 1e9;
  }
  return best;
}

}  // namespace

int main(int argc, char **argv) {
  const size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 64;
  const int repeat = argc > 2 ? std::atoi(argv[2]) : 5;
  const size_t n = mib << 20;
  std::vector<unsigned char> src(n), dst(n);
  for (size_t i = 0; i < n; ++i) src[i] = static_cast<unsigned char>(i * 131 + (i >> 12));
  std::memcpy(dst.data(), src.data(), n);  // both touched before timing
  volatile uint32_t sink = 0;
  const double copy = BestGBs(n, repeat, [&] {
    std::memcpy(dst.data(), src.data(), n);
    sink = dst[n / 2];
  });
  const double fast = BestGBs(n, repeat, [&] { sink = datadist::crc::Crc32(0, src.data(), n); });
  const double table = BestGBs(n, repeat, [&] { sink = datadist::crc::Crc32Table(0, src.data(), n); });
  // The owner's checksum (verify::Frame): read fault-safely through a per-thread scratch copy,
  // with process_vm_readv (as it runs) and with the pipe fallback (a seccomp filter's case).
  const std::vector<iovec> iov{{src.data(), n}};
  const double own = BestGBs(n, repeat, [&] { sink = datadist::crc::Crc32Own(iov).crc; });
  datadist::crc::ForcePipeForTests(true);
  const double pipe = BestGBs(n, repeat, [&] { sink = datadist::crc::Crc32Own(iov).crc; });
  datadist::crc::ForcePipeForTests(false);
  std::printf(
      "%zu MiB, best of %d: memcpy %.2f GB/s, crc32 %.2f GB/s (%s, %.2fx memcpy), crc32 table %.2f GB/s (%.2fx)\n", mib,
      repeat, copy, fast, datadist::crc::Accelerated() ? "carry-less multiply" : "table", fast / copy, table,
      table / copy);
  std::printf(
      "owner's fault-safe crc32 (Crc32Own): process_vm_readv %.2f GB/s (%.2fx crc32), pipe fallback %.2f GB/s "
      "(%.2fx)\n",
      own, own / fast, pipe, pipe / fast);
  (void)sink;
  return 0;
}

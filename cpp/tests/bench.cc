// The C++ API's benchmark: every figure beside a limit measured in the same run, between the
// same two processes (docs/cpp.md, "Speed"; `datadist bench --only cpp` runs it and prints the
// rows). Not run by ctest.
//
//   dd_bench [--mib N] [--repeat R] [--small-iters K] [--json]
//   dd_bench --attach PORT --cache-id ID --seed S [--tcp]   (see Attach below)
//
// The owner (prompt) is a child process (forked before any thread) that registers a cache of
// 32 KiB blocks (filled with a pattern) and one of 16 KiB blocks, and serves plain sockets for
// the limits. This process pulls, once over the local channel (same host: grants and
// process_vm_readv) and once with TCP forced:
//   * PullKvBlocks of one 16 KiB block, p50, vs a 16-byte request/reply on a plain TCP socket,
//     and (TCP) vs a 16-byte request answered with the same 16 KiB block on a plain socket;
//   * PullKvBlocks of N MiB as random 32 KiB blocks (8192 at 256 MiB), vs raw
//     process_vm_readv of the same iovecs (same host) or a plain socket stream of the same
//     bytes, 4 MiB recv()s (TCP).
// Figure and limit repetitions alternate; every pull's bytes are checked once after warm-up.
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

using namespace llm_datadist;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint64_t kOwner = 1, kSmallBlock = 16 << 10, kSmallBlocks = 64, kBlock = 32 << 10, kChunk = 4 << 20;
constexpr uint64_t kSeed = 0x5eed000000000000ULL;

[[noreturn]] void Die(const std::string &why) {
  std::fprintf(stderr, "dd_bench: %s\n", why.c_str());
  std::exit(1);
}

uint8_t *PageAligned(uint64_t n) {
  void *p = nullptr;
  if (posix_memalign(&p, 4096, n)) Die("out of memory");
  std::memset(p, 0, n);
  return static_cast<uint8_t *>(p);
}

CacheDesc Desc(uint64_t blocks, uint64_t block) {
  CacheDesc d{};
  d.placement = CachePlacement::kHost;
  d.num_tensors = 1;
  d.data_type = DT_UINT8;
  d.shape = {static_cast<int64_t>(blocks), static_cast<int64_t>(block)};
  return d;
}

bool Exactly(int fd, void *p, size_t n, bool send_it) {
  auto *b = static_cast<uint8_t *>(p);
  while (n) {
    ssize_t got = send_it ? send(fd, b, n, MSG_NOSIGNAL) : recv(fd, b, n, 0);
    if (got <= 0) return false;
    b += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

int Listen(uint16_t &port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof(a)) || listen(fd, 4)) Die("cannot listen");
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr *>(&a), &len);
  port = ntohs(a.sin_port);
  return fd;
}

int Dial(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof(a))) Die("cannot connect to the plain socket");
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

// ---- the owner (child process)

void Owner(uint64_t cache_blocks, int to_parent, int from_parent) {
  uint8_t *blocks = PageAligned(cache_blocks * kBlock);
  uint8_t *small = PageAligned(kSmallBlocks * kSmallBlock);
  auto *words = reinterpret_cast<uint64_t *>(blocks);
  for (uint64_t i = 0; i < cache_blocks * kBlock / 8; ++i) words[i] = i + kSeed;
  LlmDataDist p(kOwner, LlmRole::kPrompt);
  uint16_t port = 0;
  Status st = LLM_FAILED;
  for (int tries = 0; tries < 5 && st != LLM_SUCCESS; ++tries) {
    port = ddtest::FreePort();
    st = p.Initialize(ddtest::Options(port, "60000"));
  }
  if (st != LLM_SUCCESS) Die("the owner cannot listen");
  int64_t id_blocks = 0, id_small = 0;
  if (p.RegisterKvCache(Desc(cache_blocks, kBlock), {reinterpret_cast<uint64_t>(blocks)}, {}, id_blocks) ||
      p.RegisterKvCache(Desc(kSmallBlocks, kSmallBlock), {reinterpret_cast<uint64_t>(small)}, {}, id_small))
    Die("the owner cannot register");
  // The limits' plain sockets: an echo of 16 bytes ('E'), a stream of n bytes on request ('S'),
  // and a reply ('R'): a 16-byte request {n, block} answered with n <= 16 KiB bytes of that
  // block of the small cache, the bytes a small pull carries.
  uint16_t plain_port = 0;
  int lfd = Listen(plain_port);
  std::thread plain([&] {
    for (int i = 0; i < 6; ++i) {  // echo and stream (same host); echo, stream and reply (TCP)
      int fd = accept(lfd, nullptr, nullptr);
      if (fd < 0) return;
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      std::thread([fd, blocks, small, cache_blocks] {
        char kind = 0;
        if (!Exactly(fd, &kind, 1, false)) return (void)close(fd);
        if (kind == 'E') {
          uint8_t ping[16];
          while (Exactly(fd, ping, 16, false) && Exactly(fd, ping, 16, true)) {
          }
        } else if (kind == 'R') {
          uint64_t ask[2];
          while (Exactly(fd, ask, sizeof(ask), false) &&
                 Exactly(fd, small + (ask[1] % kSmallBlocks) * kSmallBlock, std::min(ask[0], kSmallBlock), true)) {
          }
        } else {
          uint64_t n = 0;
          while (Exactly(fd, &n, 8, false)) {
            for (uint64_t off = 0; off < n;) {
              uint64_t part = std::min(n - off, cache_blocks * kBlock);
              if (!Exactly(fd, blocks, part, true)) break;
              off += part;
            }
          }
        }
        close(fd);
      }).detach();
    }
  });
  std::string hello = std::to_string(port) + " " + std::to_string(plain_port) + " " +
                      std::to_string(reinterpret_cast<uint64_t>(blocks)) + "\n";
  if (write(to_parent, hello.data(), hello.size()) != static_cast<ssize_t>(hello.size())) Die("pipe");
  char c;
  while (read(from_parent, &c, 1) > 0) {
  }
  shutdown(lfd, SHUT_RDWR);
  close(lfd);
  plain.join();
  p.Finalize();
}

// ---- the puller (this process)

// Every thread of `pids` on one CPU while alive (affinity restored by the destructor): the
// latency rows compare round trips, and on two CPUs each message pays a cross-CPU wake-up that
// costs 60-80 us from an idle CPU on the development machine (the limit was bimodal). Threads
// the kernel will not move are left alone.
class OneCpu {
 public:
  explicit OneCpu(std::vector<pid_t> pids) {
    cpu_set_t mine;
    if (sched_getaffinity(0, sizeof(mine), &mine) != 0) return;
    int cpu = 0;
    while (cpu < CPU_SETSIZE && !CPU_ISSET(cpu, &mine)) ++cpu;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    for (pid_t pid : pids) {
      std::string dir = "/proc/" + std::to_string(pid) + "/task";
      DIR *d = opendir(dir.c_str());
      if (d == nullptr) continue;
      while (dirent *e = readdir(d)) {
        pid_t tid = static_cast<pid_t>(std::atoi(e->d_name));
        cpu_set_t was;
        if (tid <= 0 || sched_getaffinity(tid, sizeof(was), &was) != 0) continue;
        if (sched_setaffinity(tid, sizeof(one), &one) == 0) saved_.push_back({tid, was});
      }
      closedir(d);
    }
  }
  ~OneCpu() {
    for (auto &s : saved_) sched_setaffinity(s.tid, sizeof(s.cpus), &s.cpus);
  }
  OneCpu(const OneCpu &) = delete;
  OneCpu &operator=(const OneCpu &) = delete;

 private:
  struct Saved {
    pid_t tid;
    cpu_set_t cpus;
  };
  std::vector<Saved> saved_;
};

double Micros(Clock::time_point t0) { return std::chrono::duration<double, std::micro>(Clock::now() - t0).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::string Samples(const std::vector<double> &v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + std::to_string(v[i]);
  return out + "]";
}

struct Row {
  std::string key, title, unit, path, limit_title, goal;
  std::vector<double> figure, limit;  // us (latency) or seconds (throughput)
  uint64_t nbytes = 0;                // throughput rows
};

Row MakeRow(std::string key, std::string title, std::string unit, std::string path, std::string limit_title,
            std::string goal) {
  Row r;
  r.key = std::move(key);
  r.title = std::move(title);
  r.unit = std::move(unit);
  r.path = std::move(path);
  r.limit_title = std::move(limit_title);
  r.goal = std::move(goal);
  return r;
}

struct Setup {
  uint16_t port, plain_port;
  uint64_t owner_blocks_addr;
  pid_t pid;
  uint64_t cache_blocks, nblocks;
  int repeat, small_iters;
};

void PullRows(const Setup &s, bool tcp, std::vector<Row> &rows) {
  const char *path = tcp ? "tcp" : "cma";
  LlmDataDist d(tcp ? 3 : 2, LlmRole::kDecoder);
  auto o = ddtest::Options(0, "60000");
  o["datadist.Transport"] = tcp ? "tcp" : "auto";
  if (d.Initialize(o)) Die("the puller cannot initialize");
  uint8_t *dst = PageAligned(s.cache_blocks * kBlock);
  uint8_t *small = PageAligned(kSmallBlocks * kSmallBlock);
  Cache big{}, sm{};
  if (d.RegisterKvCache(Desc(s.cache_blocks, kBlock), {reinterpret_cast<uint64_t>(dst)}, {}, big.cache_id) ||
      d.RegisterKvCache(Desc(kSmallBlocks, kSmallBlock), {reinterpret_cast<uint64_t>(small)}, {}, sm.cache_id))
    Die("the puller cannot register");
  std::vector<Status> rets;
  if (d.LinkLlmClusters({ddtest::Cluster(kOwner, s.port)}, rets, 5000)) Die("link failed");
  // random distinct blocks in random order on both sides
  std::mt19937_64 rng(2024);
  std::vector<uint64_t> src(s.cache_blocks), dst_ids(s.cache_blocks);
  for (uint64_t i = 0; i < s.cache_blocks; ++i) src[i] = dst_ids[i] = i;
  std::shuffle(src.begin(), src.end(), rng);
  std::shuffle(dst_ids.begin(), dst_ids.end(), rng);
  src.resize(s.nblocks);
  dst_ids.resize(s.nblocks);
  auto pull_all = [&] {
    if (d.PullKvBlocks(ddtest::Index(kOwner, 1), big, src, dst_ids)) Die(std::string(path) + " PullKvBlocks failed");
  };
  pull_all();  // warm, then check every byte
  const uint64_t w = kBlock / 8;
  for (uint64_t i = 0; i < s.nblocks; ++i) {
    const auto *got = reinterpret_cast<const uint64_t *>(dst + dst_ids[i] * kBlock);
    for (uint64_t j = 0; j < w; ++j)
      if (got[j] != src[i] * w + j + kSeed) Die(std::string(path) + ": a block that arrived is not the owner's");
  }
  // the limits
  int echo = Dial(s.plain_port), stream = Dial(s.plain_port), reply = tcp ? Dial(s.plain_port) : -1;
  char e = 'E', st = 'S', rp = 'R';
  Exactly(echo, &e, 1, true);
  Exactly(stream, &st, 1, true);
  if (tcp) Exactly(reply, &rp, 1, true);
  const uint64_t nbytes = s.nblocks * kBlock;
  std::vector<iovec> local, remote;
  for (uint64_t i = 0; i < s.nblocks; ++i) {
    local.push_back({dst + dst_ids[i] * kBlock, kBlock});
    remote.push_back({reinterpret_cast<void *>(s.owner_blocks_addr + src[i] * kBlock), kBlock});
  }
  auto limit = [&] {
    if (!tcp) {
      for (size_t at = 0; at < local.size(); at += 1024) {
        size_t n = std::min<size_t>(1024, local.size() - at);
        ssize_t want = static_cast<ssize_t>(n * kBlock);
        if (process_vm_readv(s.pid, local.data() + at, n, remote.data() + at, n, 0) != want)
          Die("raw process_vm_readv failed");
      }
      return;
    }
    Exactly(stream, const_cast<uint64_t *>(&nbytes), 8, true);
    for (uint64_t off = 0; off < nbytes;) {
      uint64_t part = std::min(kChunk, nbytes - off);
      if (!Exactly(stream, dst + off, part, false)) Die("plain stream failed");
      off += part;
    }
  };
  limit();  // warm
  Row thr = MakeRow(
      std::string("cpp_") + (tcp ? "tcp" : "same_host") + "_pull_blocks",
      std::string("C++ PullKvBlocks, ") + std::to_string(s.nblocks) + " x 32 KiB, " + (tcp ? "TCP" : "same host"),
      "GB/s", path, tcp ? "plain socket send/recv, same bytes, 4 MiB chunks" : "raw process_vm_readv, same iovecs",
      ">= 0.95x");
  thr.nbytes = nbytes;
  for (int r = 0; r < s.repeat; ++r) {
    auto t0 = Clock::now();
    pull_all();
    thr.figure.push_back(Micros(t0) / 1e6);
    t0 = Clock::now();
    limit();
    thr.limit.push_back(Micros(t0) / 1e6);
  }
  // small pulls: runs of pulls and of round trips, alternating
  Row lat = MakeRow(std::string("cpp_") + (tcp ? "tcp" : "same_host") + "_small",
                    std::string("C++ PullKvBlocks, one 16 KiB block, ") + (tcp ? "TCP" : "same host"), "us",
                    tcp ? "tcp" : "cma",  // same host: copied under a whole-cache lease
                    "16-byte request/reply on a plain TCP socket, p50", "<= 1.50x");
  uint8_t ping[16] = {0}, pong[16];
  auto pull_one = [&](int i) {
    if (d.PullKvBlocks(ddtest::Index(kOwner, 2), sm, {static_cast<uint64_t>(i % kSmallBlocks)},
                       {static_cast<uint64_t>((i * 7) % kSmallBlocks)}))
      Die("small pull failed");
  };
  auto round_trip = [&] {
    if (!Exactly(echo, ping, 16, true) || !Exactly(echo, pong, 16, false)) Die("echo failed");
  };
  // TCP: the same pulls against a plain round trip that carries their bytes: 16 bytes asking
  // for the pull's source block, its 16 KiB received into the pull's destination block
  Row vs_reply =
      MakeRow("cpp_tcp_small_vs_reply", "C++ PullKvBlocks, one 16 KiB block, TCP, against a plain reply", "us", "tcp",
              "16-byte request -> 16 KiB reply on a plain TCP socket (C at both ends), p50", "<= 1.50x");
  auto reply_trip = [&](int i) {
    uint64_t ask[2] = {kSmallBlock, static_cast<uint64_t>(i % kSmallBlocks)};
    if (!Exactly(reply, ask, sizeof(ask), true) ||
        !Exactly(reply, small + ((i * 7) % kSmallBlocks) * kSmallBlock, kSmallBlock, false))
      Die("plain reply failed");
  };
  OneCpu pinned({getpid(), s.pid});
  for (int i = 0; i < 50; ++i) {
    pull_one(i);
    round_trip();
    if (tcp) reply_trip(i);
  }
  const int per = std::max(1, s.small_iters / s.repeat);
  for (int r = 0; r < s.repeat; ++r) {
    for (int i = 0; i < per; ++i) {
      auto t0 = Clock::now();
      pull_one(i);
      lat.figure.push_back(Micros(t0));
    }
    for (int i = 0; i < per; ++i) {
      auto t0 = Clock::now();
      round_trip();
      lat.limit.push_back(Micros(t0));
    }
    for (int i = 0; tcp && i < per; ++i) {
      auto t0 = Clock::now();
      reply_trip(i);
      vs_reply.limit.push_back(Micros(t0));
    }
  }
  rows.push_back(lat);
  if (tcp) {
    vs_reply.figure = lat.figure;  // the same pulls, against the limit that carries their bytes
    rows.push_back(vs_reply);
    close(reply);
  }
  rows.push_back(thr);
  close(echo);
  close(stream);
  d.Finalize();
  std::free(dst);
  std::free(small);
}

// --attach: pull from an owner that another process runs (`datadist bench`'s owner, a Python
// process on the same core), so that the two faces' small pulls are measured alike: the same
// owner and cache, the same block pairs (source i % 64 into i * 7 % 64), and the same CPU (the
// caller pins every thread of the three processes once this one said "ready"). The caller
// alternates runs of its own pulls with runs of these.
//   stdin:  "pull K" (K pulls, each timed, walking on from the last), "quit" or end of input
//   stdout: "ready" once linked, checked (one pull's bytes against the owner's pattern: word j of
//           block b is b * 2048 + j + seed) and warmed; then per "pull K" one line of K times
//           in us
// Blocks on stdin between commands; each pull has the link's deadline (60 s). Exits 1 (saying
// why on stderr) if the link, a pull or the check fails.
int Attach(uint16_t port, int64_t cache_id, uint64_t seed, bool tcp) {
  constexpr uint64_t kAttachId = 7;  // not the bench's owner (1) nor its Python puller (2)
  LlmDataDist d(kAttachId, LlmRole::kDecoder);
  auto o = ddtest::Options(0, "60000");
  o["datadist.Transport"] = tcp ? "tcp" : "auto";
  if (d.Initialize(o)) Die("the puller cannot initialize");
  uint8_t *small = PageAligned(kSmallBlocks * kSmallBlock);
  Cache sm{};
  if (d.RegisterKvCache(Desc(kSmallBlocks, kSmallBlock), {reinterpret_cast<uint64_t>(small)}, {}, sm.cache_id))
    Die("the puller cannot register");
  std::vector<Status> rets;
  if (d.LinkLlmClusters({ddtest::Cluster(kOwner, port)}, rets, 5000)) Die("link failed");
  const CacheIndex src = ddtest::Index(kOwner, cache_id);
  auto pull = [&](uint64_t i) {
    if (d.PullKvBlocks(src, sm, {i % kSmallBlocks}, {(i * 7) % kSmallBlocks})) Die("small pull failed");
  };
  pull(5);  // block 5 into block 35
  const uint64_t w = kSmallBlock / 8;
  const auto *got = reinterpret_cast<const uint64_t *>(small + 35 * kSmallBlock);
  for (uint64_t j = 0; j < w; ++j)
    if (got[j] != 5 * w + j + seed) Die("attach: the block that arrived is not the owner's");
  uint64_t n = 0;
  for (; n < 50; ++n) pull(n);
  std::printf("ready\n");
  std::fflush(stdout);
  char line[64];
  while (std::fgets(line, sizeof(line), stdin) != nullptr) {
    long k = 0;
    if (std::sscanf(line, "pull %ld", &k) != 1 || k < 1) break;  // "quit", or anything else
    std::string out;
    for (long i = 0; i < k; ++i, ++n) {
      auto t0 = Clock::now();
      pull(n);
      out += (i ? " " : "") + std::to_string(Micros(t0));
    }
    std::printf("%s\n", out.c_str());
    std::fflush(stdout);
  }
  d.Finalize();
  std::free(small);
  return 0;
}

}  // namespace

int main(int argc, char **argv) {
  int64_t mib = 256;
  int repeat = 5, small_iters = 2000;
  bool json = false, tcp = false;
  uint64_t attach = 0, seed = 0;
  int64_t cache_id = -1;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] {
      if (i + 1 >= argc) Die("missing value after " + a);
      return std::atoll(argv[++i]);
    };
    if (a == "--mib")
      mib = next();
    else if (a == "--repeat")
      repeat = static_cast<int>(next());
    else if (a == "--small-iters")
      small_iters = static_cast<int>(next());
    else if (a == "--json")
      json = true;
    else if (a == "--attach")
      attach = static_cast<uint64_t>(next());
    else if (a == "--cache-id")
      cache_id = next();
    else if (a == "--seed") {
      if (i + 1 >= argc) Die("missing value after --seed");
      seed = std::strtoull(argv[++i], nullptr, 0);
    } else if (a == "--tcp")
      tcp = true;
    else if (a.find_first_not_of("0123456789") == std::string::npos)
      mib = std::atoll(a.c_str());  // dd_bench [MiB]
    else
      Die("usage: dd_bench [--mib N] [--repeat R] [--small-iters K] [--json] | "
          "--attach PORT --cache-id ID --seed S [--tcp]");
  }
  if (attach) {
    if (attach > 65535 || cache_id < 0) Die("--attach takes a port and --cache-id an owner's cache id");
    return Attach(static_cast<uint16_t>(attach), cache_id, seed, tcp);
  }
  if (mib < 1 || repeat < 1 || small_iters < 1) Die("sizes must be >= 1");
  Setup s{};
  s.nblocks = static_cast<uint64_t>(mib) * (1 << 20) / kBlock;
  s.cache_blocks = s.nblocks + std::max<uint64_t>(1, s.nblocks / 4);
  s.repeat = repeat;
  s.small_iters = small_iters;
  int up[2], down[2];
  if (pipe(up) || pipe(down)) Die("pipe");
  pid_t child = fork();
  if (child < 0) Die("fork");
  if (child == 0) {
    close(up[0]);
    close(down[1]);
    Owner(s.cache_blocks, up[1], down[0]);
    _exit(0);
  }
  close(up[1]);
  close(down[0]);
  std::string line;
  char c;
  while (read(up[0], &c, 1) == 1 && c != '\n') line += c;
  if (std::sscanf(line.c_str(), "%hu %hu %lu", &s.port, &s.plain_port, &s.owner_blocks_addr) != 3)
    Die("the owner did not start");
  s.pid = child;
  std::vector<Row> rows;
  PullRows(s, false, rows);
  PullRows(s, true, rows);
  close(down[1]);
  int status = 0;
  waitpid(child, &status, 0);
  if (json) {
    std::printf("{\"rows\": [");
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row &r = rows[i];
      std::printf(
          "%s{\"key\": \"%s\", \"title\": \"%s\", \"unit\": \"%s\", \"path\": \"%s\", \"limit_title\": \"%s\", "
          "\"goal\": \"%s\", \"nbytes\": %lu, \"figure_samples\": %s, \"limit_samples\": %s}",
          i ? ", " : "", r.key.c_str(), r.title.c_str(), r.unit.c_str(), r.path.c_str(), r.limit_title.c_str(),
          r.goal.c_str(), static_cast<unsigned long>(r.nbytes), Samples(r.figure).c_str(), Samples(r.limit).c_str());
    }
    std::printf("]}\n");
    return 0;
  }
  for (const Row &r : rows) {
    double f = Median(r.figure), l = Median(r.limit);
    if (r.unit == "GB/s") {
      f = r.nbytes / f / 1e9;
      l = r.nbytes / l / 1e9;
      std::printf("%-48s %7.2f GB/s   limit %7.2f GB/s (%s)   %.2fx (goal %s)\n", r.title.c_str(), f, l,
                  r.limit_title.c_str(), f / l, r.goal.c_str());
    } else {
      std::printf("%-48s %7.1f us p50 limit %7.1f us (%s)   %.2fx (goal %s)\n", r.title.c_str(), f, l,
                  r.limit_title.c_str(), f / l, r.goal.c_str());
    }
  }
  return 0;
}

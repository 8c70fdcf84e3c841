// libFuzzer target: the owner's dispatch of one client's byte stream (server.h).
//
// One in-process owner for the whole run: a Server (public API only: Server, Identity,
// Registry; so it keeps working whatever the server's I/O model is inside) over a Registry
// holding two small registered caches: cache 1, healthy (2 tensors of 256 bytes, 4 units),
// and cache 3, whose tensor 1 has a hole (3 pages, the middle one made unreadable after
// registering: the careless caller of docs/reliability.md). The cache ids are those of the protocol's
// golden frames (tests/vectors/frames.txt), which seed the corpus.
//
// A second owner, the same but with a shared secret, has its pre-authentication stage fuzzed
// (a stranger cannot prove the secret, so nothing past AUTH is reached there).
//
// Each input is one connection's bytes. Its first byte chooses: bit 0 the channel (TCP on
// loopback, or the local channel, where GRANT, SHM and LEASE_REQUEST are served), bits 1-2
// how many writes the rest is split into (1 to 4, at evenly spaced points), bit 3 the owner
// with the secret. The harness
// connects, writes, shuts its sending side, and reads and discards the answers until the
// owner closes (or 5 s pass). A finding is: a crash or sanitizer report (a thread of the
// owner dying kills the process: libFuzzer reports it); or, checked every 64 inputs and
// at the end of each input that held the connection past 5 s, an honest client (HELLO, PING)
// not answered within 5 s (the owner stopped serving).
//
// Built with -DDATADIST_FUZZ=ON (clang); run by .ci/fuzz.sh with -timeout to catch hangs.
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "errors.h"
#include "local.h"
#include "net.h"
#include "registry.h"
#include "server.h"
#include "wire.h"

namespace dd = datadist;
namespace w = datadist::wire;

namespace {

constexpr uint64_t kOwnerCluster = 9;  // the plain owner's; the one with a secret is 10

struct Owner {
  dd::Registry registry;
  dd::Identity ident;
  std::unique_ptr<dd::Server> server;
  std::vector<uint8_t> healthy = std::vector<uint8_t>(2 * 256, 0x11);
  uint16_t port = 0;
  std::string local_name;

  /// `secret`: the owner a client must prove it to (its handshake's pre-auth stage fuzzed).
  Owner(uint64_t cluster, const std::string &secret) {
    ident.cluster_id = cluster;
    ident.role = 1;
    ident.secret = secret;
    registry.SetRemoteWrites(true);
    dd::CacheOptions opts;  // registered user memory: probed before it is streamed
    registry.AddAs(1, {2, 256, 4, 64, 0},
                   {reinterpret_cast<uint64_t>(healthy.data()), reinterpret_cast<uint64_t>(healthy.data() + 256)},
                   opts);
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    auto *m =
        static_cast<uint8_t *>(mmap(nullptr, 6 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (m == MAP_FAILED) std::abort();
    registry.AddAs(3, {2, 3 * page, 3, page, 0},
                   {reinterpret_cast<uint64_t>(m), reinterpret_cast<uint64_t>(m + 3 * page)}, opts);
    // Tensor 1's middle page made unreadable behind the registry's back: as unmapping it
    // would, but the address stays reserved (an unmapped page is soon mapped again by the
    // sanitizers' allocator, and the hole is gone).
    if (mprotect(m + 4 * page, page, PROT_NONE) != 0) std::abort();
    server = std::make_unique<dd::Server>(&registry, &ident);
    server->Start("127.0.0.1", 0);
    port = server->port();
    if (server->serves_local()) local_name = dd::local::Name(static_cast<uint64_t>(getpid()), cluster);
  }
};

Owner &TheOwner(bool with_secret) {
  // Live until exit: server threads may still run.
  static Owner *plain = new Owner(kOwnerCluster, "");
  static Owner *proving = new Owner(kOwnerCluster + 1, "fuzzing secret");
  return with_secret ? *proving : *plain;
}

w::Hello ClientHello() {
  w::Hello h;
  h.cluster_id = 77;
  h.role = 2;
  h.pid = 1;  // not ours: not a link to itself
  return h;
}

std::unique_ptr<dd::Conn> Connect(bool local, bool with_secret) {
  Owner &o = TheOwner(with_secret);
  try {
    if (local && !o.local_name.empty()) return dd::local::Connect(o.local_name, dd::After(5));
    return dd::Conn::Connect("127.0.0.1", o.port, dd::After(5));
  } catch (const dd::Error &) {
    return nullptr;
  }
}

/// An honest client is served, within 5 s each: HELLO answered by WELCOME, and (by the
/// owner without a secret) PING by PONG.
void CheckServing() {
  for (int i = 0; i < 4; ++i) {
    const bool local = i & 1, with_secret = i & 2;
    std::unique_ptr<dd::Conn> c = Connect(local, with_secret);
    bool ok = c != nullptr;
    try {
      std::vector<uint8_t> p;
      if (ok) c->SendFrame(w::EncodeHello(w::kHello, ClientHello(), 1), dd::After(5));
      ok = ok && c->RecvFrame(p, dd::After(5)).type == w::kWelcome;
      if (ok && !with_secret) c->SendFrame(w::EncodeU64(w::kPing, 42, 2), dd::After(5));
      ok = ok && (with_secret || c->RecvFrame(p, dd::After(5)).type == w::kPong);
    } catch (const dd::Error &e) {
      std::fprintf(stderr, "honest client: %s\n", e.what());
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "the owner%s no longer serves an honest client (%s)\n", with_secret ? " with a secret" : "",
                   local ? "local" : "tcp");
      std::abort();
    }
  }
}

/// DD_FUZZ_VERBOSE=1: the frames the owner answered, on stderr (to see what a seed reaches,
/// running the target on it: dd_fuzz_owner FILE).
void Tell(const std::vector<uint8_t> &got) {
  for (size_t at = 0; at + w::kHeaderSize <= got.size();) {
    w::Header h;
    try {
      h = w::DecodeHeader(got.data() + at);
    } catch (const dd::Error &) {
      std::fprintf(stderr, "  answer: not a frame\n");
      return;
    }
    const size_t end = std::min(got.size(), at + w::kHeaderSize + h.length);
    std::string what = w::TypeName(h.type);
    if (h.type == w::kError && end - at == w::kHeaderSize + h.length) {
      try {
        const w::ErrorMsg e =
            w::DecodeError(std::vector<uint8_t>(got.begin() + at + w::kHeaderSize, got.begin() + end));
        what += " " + std::to_string(e.code) + " " + e.message;
      } catch (const dd::Error &) {
      }
    }
    std::fprintf(stderr, "  answer: %s (rid %u, %u bytes)\n", what.c_str(), h.request_id, h.length);
    at = end;
  }
}

/// Reads and discards until the owner closes; false if it has not after `ms`.
bool Drain(int fd, int ms) {
  static const bool verbose = std::getenv("DD_FUZZ_VERBOSE") != nullptr;
  std::vector<uint8_t> got;
  char buf[65536];
  const dd::Deadline until = dd::After(ms / 1000.0);
  bool closed = false;
  while (!closed && dd::Clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    const int left =
        static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(until - dd::Clock::now()).count());
    if (poll(&p, 1, left > 0 ? left : 0) <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0 && verbose) got.insert(got.end(), buf, buf + n);
    closed = n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR);
  }
  if (verbose) Tell(got);
  return closed;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
  TheOwner(false);
  TheOwner(true);
  CheckServing();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static uint64_t runs = 0;
  if (size == 0) return 0;
  const bool local = data[0] & 1;
  const size_t writes = 1 + ((data[0] >> 1) & 3);
  const bool with_secret = data[0] & 8;
  ++data;
  --size;
  std::unique_ptr<dd::Conn> c = Connect(local, with_secret);
  if (!c) std::abort();  // the listener is gone
  const int fd = c->fd();
  size_t at = 0;
  for (size_t i = 1; i <= writes && at < size; ++i) {
    const size_t end = size * i / writes;
    while (at < end) {
      const ssize_t n = send(fd, data + at, end - at, MSG_NOSIGNAL);
      if (n <= 0) {
        at = size;  // the owner closed (refused the stream): done
        break;
      }
      at += static_cast<size_t>(n);
    }
    if (i < writes) usleep(200);  // the writes arrive as separate reads, most of the time
  }
  shutdown(fd, SHUT_WR);
  const bool closed = Drain(fd, 5000);
  c->Close();
  if (!closed || ++runs % 64 == 0) CheckServing();
  return 0;
}

#include "crc32.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <memory>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define DATADIST_CRC_CLMUL 1
#endif

namespace datadist {
namespace crc {
namespace {

constexpr uint32_t kPoly = 0xEDB88320U;  // x^32 + x^26 + ... + 1, bit-reflected

// Slicing-by-8: table k gives the CRC of byte i followed by k zero bytes.
using Tables = std::array<std::array<uint32_t, 256>, 8>;

const Tables &Table() {
  static const Tables t = [] {
    Tables s{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? kPoly ^ (c >> 1) : c >> 1;
      s[0][i] = c;
    }
    for (size_t k = 1; k < 8; ++k)
      for (uint32_t i = 0; i < 256; ++i) s[k][i] = (s[k - 1][i] >> 8) ^ s[0][s[k - 1][i] & 0xFF];
    return s;
  }();
  return t;
}

// The register (not inverted) after `n` more bytes.
uint32_t RawTable(uint32_t reg, const uint8_t *p, size_t n) {
  const Tables &t = Table();
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    const uint32_t lo = static_cast<uint32_t>(v) ^ reg, hi = static_cast<uint32_t>(v >> 32);
    reg = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^ t[3][hi & 0xFF] ^
          t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
  }
#endif
  for (; n; ++p, --n) reg = t[0][(reg ^ *p) & 0xFF] ^ (reg >> 8);
  return reg;
}

#ifdef DATADIST_CRC_CLMUL
// Folding constants for the reflected polynomial: x^(k) mod P, bit-reflected and shifted
// left by one, for the distances 4 x 128 + 32 and 4 x 128 - 32 bits (four lanes), 128 + 32
// and 128 - 32 (one lane) and 64 (128 -> 64 bits); then Barrett's P' and u' = x^64 / P.
constexpr long long kK1 = 0x154442bd4LL, kK2 = 0x1c6e41596LL;
constexpr long long kK3 = 0x1751997d0LL, kK4 = 0x0ccaa009eLL;
constexpr long long kK5 = 0x163cd6124LL;
constexpr long long kP = 0x1db710641LL, kU = 0x1f7011641LL;

__attribute__((target("pclmul,sse4.1"))) inline __m128i Fold(__m128i x, __m128i data, __m128i k) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), data);
}

__attribute__((target("pclmul,sse4.1"))) inline __m128i Load(const uint8_t *p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
}

// The register after `n` bytes, n >= 64 and a multiple of 16.
__attribute__((target("pclmul,sse4.1"))) uint32_t RawClmul(uint32_t reg, const uint8_t *p, size_t n) {
  const __m128i k12 = _mm_set_epi64x(kK2, kK1), k34 = _mm_set_epi64x(kK4, kK3);
  __m128i x0 = _mm_xor_si128(Load(p), _mm_cvtsi32_si128(static_cast<int>(reg)));
  __m128i x1 = Load(p + 16), x2 = Load(p + 32), x3 = Load(p + 48);
  for (p += 64, n -= 64; n >= 64; p += 64, n -= 64) {
    x0 = Fold(x0, Load(p), k12);
    x1 = Fold(x1, Load(p + 16), k12);
    x2 = Fold(x2, Load(p + 32), k12);
    x3 = Fold(x3, Load(p + 48), k12);
  }
  x0 = Fold(x0, x1, k34);
  x0 = Fold(x0, x2, k34);
  x0 = Fold(x0, x3, k34);
  for (; n >= 16; p += 16, n -= 16) x0 = Fold(x0, Load(p), k34);
  // 128 bits to 64, then to 32 (Barrett).
  const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
  x0 = _mm_xor_si128(_mm_clmulepi64_si128(x0, k34, 0x10), _mm_srli_si128(x0, 8));
  x0 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x0, mask32), _mm_set_epi64x(0, kK5), 0x00),
                     _mm_srli_si128(x0, 4));
  const __m128i pu = _mm_set_epi64x(kU, kP);
  __m128i t = _mm_and_si128(_mm_clmulepi64_si128(_mm_and_si128(x0, mask32), pu, 0x10), mask32);
  t = _mm_xor_si128(_mm_clmulepi64_si128(t, pu, 0x00), x0);
  return static_cast<uint32_t>(_mm_extract_epi32(t, 1));
}

bool HasClmul() {
  static const bool yes = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return yes;
}
#endif

}  // namespace

uint32_t Crc32Table(uint32_t crc, const void *data, size_t n) {
  return ~RawTable(~crc, static_cast<const uint8_t *>(data), n);
}

uint32_t Crc32(uint32_t crc, const void *data, size_t n) {
  const auto *p = static_cast<const uint8_t *>(data);
  uint32_t reg = ~crc;
#ifdef DATADIST_CRC_CLMUL
  if (n >= 64 && HasClmul()) {
    const size_t blocks = n & ~static_cast<size_t>(15);
    reg = RawClmul(reg, p, blocks);
    p += blocks;
    n -= blocks;
  }
#endif
  return ~RawTable(reg, p, n);
}

uint32_t Crc32Iov(const std::vector<iovec> &iov) {
  uint32_t crc = 0;
  for (const iovec &v : iov) crc = Crc32(crc, v.iov_base, v.iov_len);
  return crc;
}

bool Accelerated() {
#ifdef DATADIST_CRC_CLMUL
  return HasClmul();
#else
  return false;
#endif
}

namespace {

constexpr size_t kScratch = 256 << 10;   // per thread: fits a core's L2, so the CRC reads it there
constexpr size_t kMaxSpans = 1024;       // remote iovecs per process_vm_readv (IOV_MAX)
constexpr size_t kPipeChunk = 64 << 10;  // a default pipe's capacity: a write into an empty one never waits

std::atomic<bool> vm_refused{false};  // process_vm_readv answered EPERM/ENOSYS once: the pipe from then on
std::atomic<bool> force_pipe{false};

/// The calling thread's scratch buffer and fallback pipe, made at first use, gone with the thread.
struct ThreadState {
  std::unique_ptr<uint8_t[]> scratch{new uint8_t[kScratch]};
  int pipe_fds[2] = {-1, -1};
  ~ThreadState() {
    for (int fd : pipe_fds)
      if (fd >= 0) close(fd);
  }
  bool Pipe() {
    if (pipe_fds[0] >= 0) return true;
    return pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) == 0;
  }
};

ThreadState &State() {
  thread_local ThreadState state;
  return state;
}

/// Where the read stands: span `span`, `off` bytes into it.
struct Cursor {
  const std::vector<iovec> &iov;
  size_t span = 0, off = 0;
  void SkipEmpty() {
    while (span < iov.size() && off == iov[span].iov_len) ++span, off = 0;
  }
  bool Done() {
    SkipEmpty();
    return span == iov.size();
  }
  uintptr_t Addr() const { return reinterpret_cast<uintptr_t>(iov[span].iov_base) + off; }
  void Advance(size_t n) {
    while (n > 0) {
      const size_t step = std::min(n, iov[span].iov_len - off);
      off += step;
      n -= step;
      SkipEmpty();
    }
  }
};

/// One pipe round: up to kPipeChunk bytes of the current span written into the empty pipe,
/// read back into `dst`. Returns the bytes read, 0 when the first byte faults, -1 when the
/// pipe fails otherwise.
ssize_t ThroughPipe(ThreadState &st, const Cursor &at, uint8_t *dst) {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  size_t want = std::min(kPipeChunk, at.iov[at.span].iov_len - at.off);
  ssize_t put;
  for (;;) {
    put = write(st.pipe_fds[1], reinterpret_cast<const void *>(at.Addr()), want);
    if (put >= 0) break;
    if (errno == EINTR) continue;
    if (errno != EFAULT) return -1;
    // A write that faults may copy nothing: narrow it to the first page, so that the bytes
    // before the hole are read and the hole is found to the page.
    const size_t to_page = page - at.Addr() % page;
    if (want <= to_page) return 0;  // this page is not readable
    want = to_page;
  }
  size_t got = 0;
  while (got < static_cast<size_t>(put)) {
    const ssize_t r = read(st.pipe_fds[0], dst + got, static_cast<size_t>(put) - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;  // cannot happen: the bytes are in the pipe
    got += static_cast<size_t>(r);
  }
  return put;
}

}  // namespace

OwnRead Crc32Own(const std::vector<iovec> &iov, uint32_t crc) {
  OwnRead out;
  ThreadState &st = State();
  uint8_t *scratch = st.scratch.get();
  Cursor at{iov};
  iovec remote[kMaxSpans];
  while (!at.Done()) {
    ssize_t got = -1;
    if (!vm_refused.load(std::memory_order_relaxed) && !force_pipe.load(std::memory_order_relaxed)) {
      size_t want = 0, k = 0;
      for (size_t s = at.span, off = at.off; s < iov.size() && k < kMaxSpans && want < kScratch; ++s, off = 0) {
        const size_t len = std::min(iov[s].iov_len - off, kScratch - want);
        if (len == 0) continue;
        remote[k++] = {static_cast<uint8_t *>(iov[s].iov_base) + off, len};
        want += len;
      }
      iovec local{scratch, want};
      got = process_vm_readv(getpid(), &local, 1, remote, k, 0);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && errno == EFAULT) got = 0;  // the first byte is not readable
      if (got < 0 && (errno == EPERM || errno == ENOSYS)) vm_refused.store(true, std::memory_order_relaxed);
      // any other failure (ENOMEM: the kernel short of memory) tries the pipe for this chunk
    }
    if (got < 0) {
      if (!st.Pipe()) {
        out.refused = "no fault-safe read of our own memory: process_vm_readv is refused and no pipe can be made";
        return out;
      }
      got = ThroughPipe(st, at, scratch);
      if (got < 0) {
        out.refused = "no fault-safe read of our own memory: the pipe failed";
        return out;
      }
    }
    if (got == 0) {  // the byte at the cursor cannot be read
      out.bad = at.Addr();
      return out;
    }
    crc = Crc32(crc, scratch, static_cast<size_t>(got));
    at.Advance(static_cast<size_t>(got));  // a short read: the next call starts at the hole
  }
  out.ok = true;
  out.crc = crc;
  return out;
}

void ForcePipeForTests(bool on) { force_pipe.store(on, std::memory_order_relaxed); }

}  // namespace crc
}  // namespace datadist

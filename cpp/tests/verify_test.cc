// Checksummed pulls (verify.h, crc32.h): zlib's CRC-32 computed fast and exactly, the C++
// API's datadist.VerifyChecksum option end to end (between two instances, over TCP and the
// local channel's grants), and against a hand-written owner: the CHECKSUM frame read, the
// verdict sent (RELEASE, lease 0, the READ's id), a lying owner's bytes refused with
// LLM_SUSPECT_REMOTE_ERROR.
#include "verify.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "crc32.h"
#include "errors.h"
#include "net.h"
#include "tasks.h"
#include "test_util.h"
#include "wire.h"

namespace {

using namespace llm_datadist;
using datadist::After;
namespace w = datadist::wire;
namespace crc = datadist::crc;

TEST(Crc32, IsZlibsCrc32) {
  EXPECT_EQ(crc::Crc32(0, "", 0), 0U);
  EXPECT_EQ(crc::Crc32(0, "123456789", 9), 0xCBF43926U);  // the CRC-32 check value
  EXPECT_EQ(crc::Crc32(crc::Crc32(0, "1234", 4), "56789", 5), 0xCBF43926U);
  std::string a(1000, 'a');  // zlib.crc32(b"a" * 1000)
  EXPECT_EQ(crc::Crc32(0, a.data(), a.size()), 0x9A38DA03U);
  EXPECT_EQ(w::Crc32(0, "123456789", 9), 0xCBF43926U);  // the codec's (layout tags)
}

TEST(Crc32, TheFastPathGivesTheTablesValueAtEveryLengthAndAlignment) {
  std::mt19937_64 rng(7);
  std::vector<uint8_t> buf(4096 + 64);
  for (auto &b : buf) b = static_cast<uint8_t>(rng());
  for (size_t off = 0; off < 16; ++off)
    for (size_t n = 0; n <= 1100; ++n)
      ASSERT_EQ(crc::Crc32(0x12345678U, buf.data() + off, n), crc::Crc32Table(0x12345678U, buf.data() + off, n))
          << "offset " << off << " length " << n << (crc::Accelerated() ? " (carry-less)" : " (table)");
  EXPECT_EQ(crc::Crc32(0, buf.data(), 4096), crc::Crc32Table(0, buf.data(), 4096));
  // spans chain as one stream
  std::vector<iovec> iov{{buf.data(), 7}, {buf.data() + 7, 0}, {buf.data() + 7, 300}, {buf.data() + 307, 3789}};
  EXPECT_EQ(crc::Crc32Iov(iov), crc::Crc32(0, buf.data(), 4096));
}

// The owner's checksum reads registered memory on a peer's behalf: fault-safely (issue 35,
// item 4). Before, verify::Frame ran the CRC in-process and these tests died of SIGSEGV.

/// Three pages, the middle one unmapped (the caller freed part of a registered tensor).
class Holed {
 public:
  Holed() : page_(static_cast<size_t>(sysconf(_SC_PAGESIZE))) {
    void *m = mmap(nullptr, 3 * page_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(m, MAP_FAILED);
    base_ = static_cast<uint8_t *>(m);
    std::memset(base_, 0x5a, 3 * page_);
    EXPECT_EQ(munmap(base_ + page_, page_), 0);
  }
  ~Holed() {
    munmap(base_, page_);
    munmap(base_ + 2 * page_, page_);
  }
  uint8_t *base() const { return base_; }
  size_t page() const { return page_; }

 private:
  size_t page_;
  uint8_t *base_ = nullptr;
};

/// Runs the cases with process_vm_readv, then with the pipe fallback (a seccomp filter's case).
class OwnRead : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override { crc::ForcePipeForTests(GetParam()); }
  void TearDown() override { crc::ForcePipeForTests(false); }
};

TEST_P(OwnRead, GivesCrc32IovsValueOverManySpansAndChunks) {
  std::mt19937_64 rng(11);
  std::vector<uint8_t> buf((1 << 20) + 333);
  for (auto &b : buf) b = static_cast<uint8_t>(rng());
  // one span over several scratch chunks; then more spans than one call takes (1024), some empty
  std::vector<std::vector<iovec>> cases{{{buf.data() + 1, buf.size() - 1}}, {}};
  for (size_t at = 0, i = 0; at + 700 < buf.size() && i < 2500; at += 400, ++i)
    cases[1].push_back({buf.data() + at, i % 7 == 0 ? 0 : 300 + i % 100});
  cases.push_back({});
  for (const auto &iov : cases) {
    const crc::OwnRead r = crc::Crc32Own(iov);
    ASSERT_TRUE(r.ok) << (r.refused ? r.refused : "a hole?");
    EXPECT_EQ(r.crc, crc::Crc32Iov(iov)) << iov.size() << " spans";
  }
}

TEST_P(OwnRead, AHoleIsAnAnswerNotASegfault) {
  Holed m;
  const uintptr_t hole = reinterpret_cast<uintptr_t>(m.base() + m.page());
  // the hole anywhere: at the start of a span, inside one, after whole healthy spans
  const std::vector<std::vector<iovec>> cases{{{m.base(), 3 * m.page()}},
                                              {{m.base(), 10}, {m.base() + m.page() - 5, 100}},
                                              {{m.base(), m.page()}, {m.base() + m.page(), 1}},
                                              {{m.base() + 2 * m.page(), 64}, {m.base() + m.page() + 7, 1}}};
  for (const auto &iov : cases) {
    const crc::OwnRead r = crc::Crc32Own(iov);
    EXPECT_FALSE(r.ok);
    EXPECT_EQ(r.refused, nullptr);
    EXPECT_GE(r.bad, hole);
    EXPECT_LT(r.bad, hole + m.page());
  }
  // the pages around it are read as usual
  const std::vector<iovec> healthy{{m.base(), m.page()}, {m.base() + 2 * m.page(), m.page()}};
  const crc::OwnRead r = crc::Crc32Own(healthy);
  ASSERT_TRUE(r.ok);
  EXPECT_EQ(r.crc, crc::Crc32Iov(healthy));
}

TEST_P(OwnRead, TheOwnersChecksumFrameOverAHoleIsDeviceMemError) {
  Holed m;
  const std::vector<iovec> src{{m.base(), 3 * m.page()}};
  try {
    datadist::verify::Frame(src, 9, "cache 4 tensor 1");
    FAIL() << "a checksum over unmapped memory";
  } catch (const datadist::Error &e) {
    EXPECT_EQ(e.code(), datadist::kDeviceMemError);
    EXPECT_NE(std::string(e.what()).find("cache 4 tensor 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("not mapped"), std::string::npos) << e.what();
  }
  // and the frame over healthy memory is the CRC of its bytes
  const std::vector<iovec> ok{{m.base(), m.page()}};
  std::vector<uint8_t> frame = datadist::verify::Frame(ok, 9);
  std::vector<uint8_t> payload(frame.begin() + w::kHeaderSize, frame.end());
  const w::Checksum ck = datadist::verify::Expect(w::DecodeHeader(frame.data()), payload);
  EXPECT_EQ(ck.crc, crc::Crc32Iov(ok));
  EXPECT_EQ(ck.nbytes, m.page());
}

INSTANTIATE_TEST_SUITE_P(Crc32Own, OwnRead, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool> &p) { return p.param ? "Pipe" : "ProcessVmReadv"; });

/// An owner written by hand: WELCOME, then every READ answered with READ_DATA and a pattern,
/// and with its CHECKSUM frame when the READ asks for one (`lie`: a wrong CRC); records what
/// it saw (the flags, and the frame after the CHECKSUM).
class HandOwner {
 public:
  explicit HandOwner(bool lie) : lie_(lie) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (bind(fd_, reinterpret_cast<sockaddr *>(&a), sizeof(a)) != 0 || listen(fd_, 4) != 0 ||
        getsockname(fd_, reinterpret_cast<sockaddr *>(&a), &len) != 0)
      ADD_FAILURE() << "cannot listen";
    port = ntohs(a.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~HandOwner() {
    shutdown(fd_, SHUT_RDWR);
    thread_.join();
    close(fd_);
  }
  static uint8_t Byte(size_t i) { return static_cast<uint8_t>(i * 31 + 5); }

  uint16_t port = 0;
  std::mutex mu;                     // guards the three below
  std::vector<uint32_t> flags;       // of each READ
  std::vector<w::Header> after;      // the frame after each CHECKSUM
  std::vector<w::Release> verdicts;  // ... when it was a RELEASE

 private:
  void Serve() {
    int c = accept(fd_, nullptr, nullptr);
    if (c < 0) return;
    datadist::Conn conn(c, "hand");
    try {
      std::vector<uint8_t> payload;
      w::Header h = conn.RecvFrame(payload, After(5));
      w::Hello welcome;
      welcome.cluster_id = 2;
      conn.SendFrame(w::EncodeHello(w::kWelcome, welcome, h.request_id), After(5));
      bool pending = false;
      while (true) {
        h = conn.RecvFrame(payload, After(30));
        if (pending) {
          std::lock_guard<std::mutex> lock(mu);
          after.push_back(h);
          if (h.type == w::kRelease) verdicts.push_back(w::DecodeRelease(payload));
          pending = false;
          if (h.type == w::kRelease) continue;
        }
        if (h.type == w::kBye) {
          conn.SendFrame(w::EncodeEmpty(w::kOk, h.request_id), After(5));
          return;
        }
        if (h.type != w::kRead) return;
        w::Request q = w::DecodeRequest(h.type, payload);
        {
          std::lock_guard<std::mutex> lock(mu);
          flags.push_back(q.flags);
        }
        uint64_t n = 0;
        for (uint64_t l : q.lengths) n += l * q.tensors.size();
        std::vector<uint8_t> bytes(n);
        for (size_t i = 0; i < n; ++i) bytes[i] = Byte(i);
        conn.SendFrame(w::EncodeU64(w::kReadData, n, h.request_id), After(5));
        conn.SendAll(bytes.data(), n, After(5));
        if (q.flags & w::kFlagChecksum) {
          const uint32_t crc = crc::Crc32(0, bytes.data(), n) ^ (lie_ ? 1U : 0U);
          conn.SendFrame(w::EncodeChecksum(crc, n, h.request_id), After(5));
          pending = true;
        }
      }
    } catch (const std::exception &) {
    }
  }
  bool lie_;
  int fd_;
  std::thread thread_;
};

std::map<AscendString, AscendString> Verifying(uint16_t listen_port = 0, const char *value = "1") {
  auto o = ddtest::Options(listen_port);
  o[OPTION_DATADIST_VERIFY_CHECKSUM] = value;
  return o;
}

void PullFromHand(bool lie, bool verify) {
  HandOwner owner(lie);
  ddtest::HostCache dst(2, {4, 16});
  LlmDataDist dd(1, LlmRole::kDecoder);
  ASSERT_EQ(dd.Initialize(verify ? Verifying() : ddtest::Options()), LLM_SUCCESS);
  ASSERT_EQ(dst.Register(dd), LLM_SUCCESS);
  std::vector<Status> rets;
  ASSERT_EQ(dd.LinkLlmClusters({ddtest::Cluster(2, owner.port)}, rets, 2000), LLM_SUCCESS);
  const Status s = dd.PullKvCache(ddtest::Index(2, 1, 0), dst.cache, 1);
  // then a plain PING-free request on the same link: the stream is still in step
  const Status again = dd.PullKvCache(ddtest::Index(2, 1, 0), dst.cache, 2);
  std::vector<Status> un;
  // BYE, answered once the owner has seen every frame before it
  ASSERT_EQ(dd.UnlinkLlmClusters({ddtest::Cluster(2, owner.port)}, un, 2000, false), LLM_SUCCESS);
  std::lock_guard<std::mutex> lock(owner.mu);
  ASSERT_EQ(owner.flags.size(), 2U);
  if (!verify) {
    EXPECT_EQ(s, LLM_SUCCESS);
    EXPECT_EQ(owner.flags[0] & w::kFlagChecksum, 0U);
    EXPECT_TRUE(owner.after.empty());
    return;
  }
  EXPECT_NE(owner.flags[0] & w::kFlagChecksum, 0U);
  EXPECT_EQ(s, lie ? datadist::kSuspectRemoteError : LLM_SUCCESS);
  EXPECT_EQ(again, s);
  ASSERT_EQ(owner.verdicts.size(), 2U);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(owner.after[i].type, w::kRelease);
    EXPECT_EQ(owner.after[i].request_id, i == 0 ? 2U : 3U);  // the READ's id (HELLO was 1)
    EXPECT_EQ(owner.verdicts[i].lease_id, 0U);
    EXPECT_EQ(owner.verdicts[i].ok, !lie);
  }
  if (!lie) {
    for (size_t i = 0; i < 16; ++i) EXPECT_EQ(dst.T(0)[32 + i], HandOwner::Byte(i));
  }
}

TEST(Verify, AnHonestOwnersBytesAreConfirmed) { PullFromHand(false, true); }
TEST(Verify, ALyingOwnersBytesAreSuspectAndNotConfirmed) { PullFromHand(true, true); }
TEST(Verify, WithoutTheOptionNoChecksumIsAskedFor) { PullFromHand(false, false); }

TEST(Verify, TheOptionIsOneOrZero) {
  LlmDataDist dd(1, LlmRole::kDecoder);
  EXPECT_EQ(dd.Initialize(Verifying(0, "maybe")), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.Initialize(Verifying(0, "0")), LLM_SUCCESS);
}

// A mismatch is told by its kind, not by its text (the binding raises IntegrityError for it;
// a peer's protocol error has the same code): thrown so, and kept so by an issued transfer.
TEST(Verify, AMismatchIsItsOwnKind) {
  try {
    datadist::verify::Mismatch("the bytes differ");
    FAIL() << "no throw";
  } catch (const datadist::Error &e) {
    EXPECT_EQ(e.code(), datadist::kSuspectRemoteError);
    EXPECT_EQ(e.kind(), datadist::ErrorKind::kChecksumMismatch);
  }
  try {
    datadist::ProtocolViolation("checksum mismatch, says a lying peer");
  } catch (const datadist::Error &e) {
    EXPECT_EQ(e.kind(), datadist::ErrorKind::kGeneral);  // the same words, not the same kind
  }
  datadist::Executor workers(1);
  auto task = workers.Submit([] { datadist::verify::Mismatch("the bytes differ"); });
  ASSERT_TRUE(task->Wait(datadist::After(10)));
  EXPECT_EQ(task->code(), datadist::kSuspectRemoteError);
  EXPECT_EQ(task->kind(), datadist::ErrorKind::kChecksumMismatch);
  workers.Stop();
}

// Two instances with the option, over TCP (streamed) and the local channel (a slot above
// 64 KiB is granted and copied with process_vm_readv; blocks below stream there).
void PullBetweenInstances(const char *transport) {
  constexpr int64_t kRow = 96 << 10;
  ddtest::HostCache src(2, {2, kRow}), dst(2, {2, kRow});
  src.Fill(3);
  const uint16_t port = ddtest::FreePort();
  LlmDataDist prompt(0, LlmRole::kPrompt), decoder(5, LlmRole::kDecoder);
  auto po = ddtest::Options(port);
  po[AscendString("datadist.Transport")] = transport;
  ASSERT_EQ(prompt.Initialize(po), LLM_SUCCESS);
  auto dopt = Verifying();
  dopt[AscendString("datadist.Transport")] = transport;
  ASSERT_EQ(decoder.Initialize(dopt), LLM_SUCCESS);
  ASSERT_EQ(src.Register(prompt), LLM_SUCCESS);
  ASSERT_EQ(dst.Register(decoder), LLM_SUCCESS);
  std::vector<Status> rets;
  ASSERT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(0, port)}, rets, 3000), LLM_SUCCESS);
  ASSERT_EQ(decoder.PullKvCache(ddtest::Index(0, 1, 1), dst.cache, 0), LLM_SUCCESS);
  for (int t = 0; t < 2; ++t) ASSERT_EQ(std::memcmp(dst.T(t), src.T(t) + kRow, kRow), 0) << t;
  ASSERT_EQ(decoder.PullKvBlocks(ddtest::Index(0, 1), dst.cache, {0}, {1}), LLM_SUCCESS);
  for (int t = 0; t < 2; ++t) ASSERT_EQ(std::memcmp(dst.T(t) + kRow, src.T(t), kRow), 0) << t;
}

TEST(Verify, PullsBetweenInstancesOverTcp) { PullBetweenInstances("tcp"); }
TEST(Verify, PullsBetweenInstancesOnOneHost) { PullBetweenInstances("auto"); }

}  // namespace

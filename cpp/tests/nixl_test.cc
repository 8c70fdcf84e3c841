// NIXL in the core (src/nixl.h) under the C++ API: the serving options (docs/cpp.md), the
// consent rules a C++ owner applies to every NIXL request (docs/security.md, "The NIXL path"),
// and, where NIXL's C API is at hand (DATADIST_NIXL_LIBRARY: tests/cpp/test_ctest.py passes the
// nixl-cu12 wheel's libnixl_capi.so), an owner that hands out its metadata and NIXL grants
// for checked spans only. Without the library those tests skip.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "errors.h"
#include "net.h"
#include "nixl.h"
#include "test_util.h"
#include "wire.h"

namespace {

using namespace llm_datadist;
namespace w = datadist::wire;
using datadist::After;
using ddtest::HostCache;

/// A hand-driven client of an owner's control channel (HELLO done).
class Raw {
 public:
  explicit Raw(uint16_t port) {
    conn_ = datadist::Conn::Connect("127.0.0.1", port, After(2));
    w::Hello h;
    h.cluster_id = 77;
    h.role = 2;
    h.pid = 1;
    EXPECT_EQ(Call(w::EncodeHello(w::kHello, h, ++rid_)).type, w::kWelcome);
  }
  w::Header Call(const std::vector<uint8_t> &frame) {
    conn_->SendFrame(frame, After(5));
    return conn_->RecvFrame(payload, After(5));
  }
  w::Header Read(uint8_t kind, uint64_t a, uint32_t tensor, uint64_t offset, uint64_t length) {
    w::Request q;
    q.kind = kind;
    q.a = a;
    q.tensors = {tensor};
    q.offsets = {offset};
    q.lengths = {length};
    return Call(w::EncodeRequest(w::kNixlRead, q, ++rid_));
  }
  void Send(const std::vector<uint8_t> &frame) { conn_->SendFrame(frame, After(5)); }
  uint32_t next_rid() { return ++rid_; }
  std::vector<uint8_t> payload;

 private:
  std::unique_ptr<datadist::Conn> conn_;
  uint32_t rid_ = 0;
};

/// ERROR with `code` whose message holds `why`.
void ExpectRefused(Raw &raw, const w::Header &h, Status code, const std::string &why) {
  ASSERT_EQ(h.type, w::kError);
  w::ErrorMsg e = w::DecodeError(raw.payload);
  EXPECT_EQ(static_cast<Status>(e.code), code) << e.message;
  EXPECT_NE(e.message.find(why), std::string::npos) << e.message;
}

const char *NixlLibrary() {
  const char *lib = std::getenv("DATADIST_NIXL_LIBRARY");
  return lib && *lib ? lib : nullptr;
}

TEST(Nixl, ServeOptionsAreZeroOrOne) {
  LlmDataDist dd(1, LlmRole::kPrompt);
  auto options = ddtest::Options();
  options[AscendString(OPTION_DATADIST_NIXL_SERVE)] = AscendString("yes");
  EXPECT_EQ(dd.Initialize(options), LLM_PARAM_INVALID);
  options[AscendString(OPTION_DATADIST_NIXL_SERVE)] = AscendString("0");
  options[AscendString(OPTION_DATADIST_NIXL_WHOLE_PROCESS)] = AscendString("maybe");
  EXPECT_EQ(dd.Initialize(options), LLM_PARAM_INVALID);
}

// NIXL merely there is no consent: an owner without the option answers every NIXL request
// with FEATURE_NOT_ENABLED and the reason, and the connection stays usable. Before: the
// core took NIXL's message types for unknown frames and dropped the connection.
TEST(Nixl, AnOwnerWithoutTheOptionRefusesEveryNixlRequest) {
  const uint16_t port = ddtest::FreePort();
  LlmDataDist prompt(1, LlmRole::kPrompt);
  ASSERT_EQ(prompt.Initialize(ddtest::Options(port)), LLM_SUCCESS);
  HostCache src(1, {4, 16});
  ASSERT_EQ(src.Register(prompt), LLM_SUCCESS);
  Raw raw(port);
  ExpectRefused(raw, raw.Call(w::EncodeEmpty(w::kNixlMdRequest, raw.next_rid())), LLM_FEATURE_NOT_ENABLED,
                "datadist.NixlServe");
  ExpectRefused(raw, raw.Read(w::kCacheId, 1, 0, 0, 16), LLM_FEATURE_NOT_ENABLED, "datadist.NixlServe");
  w::NixlLease q;
  q.kind = w::kCacheId;
  q.a = 1;
  ExpectRefused(raw, raw.Call(w::EncodeNixlLease(q, raw.next_rid())), LLM_FEATURE_NOT_ENABLED, "datadist.NixlServe");
  // NIXL_REVOKE is the owner's to send, on a reverse channel: from a client it is refused.
  ExpectRefused(raw, raw.Call(w::EncodeU64(w::kNixlRevoke, 1, raw.next_rid())), LLM_FEATURE_NOT_ENABLED, "client");
  EXPECT_EQ(raw.Call(w::EncodeU64(w::kPing, 5, raw.next_rid())).type, w::kPong);
  prompt.Finalize();
}

TEST(Nixl, WhichUcxTransportsCountAsKeyChecked) {
  const char *saved = std::getenv("UCX_TLS");
  const std::string keep = saved ? saved : "";
  unsetenv("UCX_TLS");
  EXPECT_NE(datadist::nixl::UncheckedTransports().find("UCX_TLS is not set"), std::string::npos);
  setenv("UCX_TLS", "^tcp", 1);
  EXPECT_NE(datadist::nixl::UncheckedTransports().find("excludes"), std::string::npos);
  setenv("UCX_TLS", "rc,TCP", 1);
  EXPECT_NE(datadist::nixl::UncheckedTransports().find("names tcp"), std::string::npos);
  setenv("UCX_TLS", "RC,\\ud_verbs", 1);  // case and UCX's strict-name prefix: checked names
  const std::string why = datadist::nixl::UncheckedTransports();
  EXPECT_TRUE(why.empty() || why.find("no RDMA device") != std::string::npos) << why;
  EXPECT_NE(datadist::nixl::WholeProcessReach(), "");  // never empty: software RMA at least
  if (saved) {
    setenv("UCX_TLS", keep.c_str(), 1);
  } else {
    unsetenv("UCX_TLS");
  }
}

/// An owner serving NIXL with `options` added (the library from DATADIST_NIXL_LIBRARY).
class Serving : public ::testing::Test {
 protected:
  void SetUp() override {
    if (NixlLibrary() == nullptr) GTEST_SKIP() << "DATADIST_NIXL_LIBRARY is not set (no nixl-cu12 here)";
    port = ddtest::FreePort();
    auto options = ddtest::Options(port);
    options[AscendString(OPTION_DATADIST_NIXL_SERVE)] = AscendString("1");
    options[AscendString(OPTION_DATADIST_NIXL_WHOLE_PROCESS)] = AscendString(whole ? "1" : "0");
    options[AscendString(OPTION_DATADIST_NIXL_LIBRARY)] = AscendString(NixlLibrary());
    ASSERT_EQ(prompt.Initialize(options), LLM_SUCCESS);
    ASSERT_EQ(src.Register(prompt), LLM_SUCCESS);
  }
  void TearDown() override { prompt.Finalize(); }
  bool whole = true;
  uint16_t port = 0;
  HostCache src{2, {4, 16}};
  LlmDataDist prompt{1, LlmRole::kPrompt};
};

TEST_F(Serving, MetadataAndGrantsForCheckedSpansOnly) {
  Raw raw(port);
  ASSERT_EQ(raw.Call(w::EncodeEmpty(w::kNixlMdRequest, raw.next_rid())).type, w::kNixlMd);
  const w::NixlMd md = w::DecodeNixlMd(raw.payload);
  EXPECT_EQ(md.agent.rfind("datadist-1-", 0), 0U) << md.agent;
  EXPECT_FALSE(md.metadata.empty());
  // Bounds are checked before anything is granted; the connection stays usable.
  ExpectRefused(raw, raw.Read(w::kCacheId, 1, 0, 60, 8), LLM_PARAM_INVALID, "");
  ExpectRefused(raw, raw.Read(w::kCacheId, 9, 0, 0, 8), LLM_KV_CACHE_NOT_EXIST, "");
  ASSERT_EQ(raw.Read(w::kCacheId, 1, 1, 16, 8).type, w::kNixlGrant);
  const w::NixlGrant g = w::DecodeNixlGrant(raw.payload);
  EXPECT_EQ(g.agent, md.agent);
  EXPECT_EQ(g.mem, w::kMemDram);
  ASSERT_EQ(g.bases.size(), 1U);
  EXPECT_EQ(g.bases[0], src.addrs[1]);  // the tensor's own unit base: offsets add to it
  raw.Send(w::EncodeRelease({g.lease_id, true}, raw.next_rid()));
  EXPECT_EQ(raw.Call(w::EncodeU64(w::kPing, 5, raw.next_rid())).type, w::kPong);
}

// A C++ decoder forced to NIXL (datadist.Transport "nixl") pulls from and pushes to a C++ owner
// serving NIXL: every byte arrives, repeated pulls go under a lease, an unknown cache is
// refused by the owner before anything moves. Before: "nixl" was LLM_FEATURE_NOT_ENABLED.
TEST_F(Serving, ACppDecoderForcedToNixlPullsAndPushes) {
  src.Fill(3);
  LlmDataDist decoder(2, LlmRole::kDecoder);
  auto options = ddtest::Options();
  options[AscendString("datadist.Transport")] = AscendString("nixl");
  options[AscendString(OPTION_DATADIST_NIXL_WHOLE_PROCESS)] = AscendString("1");
  options[AscendString(OPTION_DATADIST_NIXL_LIBRARY)] = AscendString(NixlLibrary());
  ASSERT_EQ(decoder.Initialize(options), LLM_SUCCESS);
  HostCache dst(2, {4, 16});
  ASSERT_EQ(dst.Register(decoder), LLM_SUCCESS);
  std::vector<Status> rets;
  ASSERT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(1, port)}, rets, 3000), LLM_SUCCESS);
  for (int round = 0; round < 3; ++round) {  // a grant, then under a lease
    std::memset(dst.T(0), 0, dst.bytes);
    std::memset(dst.T(1), 0, dst.bytes);
    ASSERT_EQ(decoder.PullKvCache(ddtest::Index(1, 1, 2), dst.cache, 1), LLM_SUCCESS);
    for (size_t t = 0; t < 2; ++t)
      for (uint64_t i = 0; i < 16; ++i) ASSERT_EQ(dst.T(t)[16 + i], src.T(t)[2 * 16 + i]) << t << " " << i;
  }
  EXPECT_EQ(decoder.PullKvCache(ddtest::Index(1, 9), dst.cache), LLM_KV_CACHE_NOT_EXIST);
  dst.Fill(8);
  ASSERT_EQ(decoder.PushKvCache(dst.cache, ddtest::Index(1, 1, 0), 3), LLM_SUCCESS);
  for (size_t t = 0; t < 2; ++t)
    for (uint64_t i = 0; i < 16; ++i) ASSERT_EQ(src.T(t)[i], dst.T(t)[3 * 16 + i]) << t << " " << i;
  decoder.Finalize();
}

class ServingWithoutAllowance : public Serving {
 protected:
  void SetUp() override {
    whole = false;
    Serving::SetUp();
  }
};

// On this host's UCX transports (tcp, shared memory) a NIXL peer reaches the whole process:
// NixlServe alone is refused, naming the allowance.
TEST_F(ServingWithoutAllowance, IsRefusedNamingTheAllowance) {
  if (datadist::nixl::UncheckedTransports().empty()) GTEST_SKIP() << "key-checked UCX transports here";
  Raw raw(port);
  ExpectRefused(raw, raw.Call(w::EncodeEmpty(w::kNixlMdRequest, raw.next_rid())), LLM_FEATURE_NOT_ENABLED,
                "NixlAllowWholeProcessAccess");
}

}  // namespace

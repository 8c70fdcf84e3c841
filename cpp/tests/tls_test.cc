// Mutual TLS through the C++ API (the datadist.Tls* options of llm_datadist.h): links, pulls
// and the listener's pushes over a TLS link; a peer another CA signed, or one without TLS,
// refused either way; the options checked at Initialize; and clients that stall mid-handshake
// hold no I/O thread. Certificates are made with the openssl command (skipped without it).
#include "tls.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "test_util.h"

namespace {

using namespace llm_datadist;
using ddtest::HostCache;
using ddtest::Index;

/// A CA ("ca"), a second one ("evil"), and leaves "a", "b" (signed by ca) and "stranger"
/// (signed by evil), in a fresh directory; "" when openssl is not there.
std::string MakeCerts() {
  static std::string dir = [] {
    if (std::system("command -v openssl >/dev/null 2>&1") != 0) return std::string();
    char tmpl[] = "/tmp/datadist-tls-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return std::string();
    std::string d = tmpl;
    std::string script = "cd " + d + " && exec >/dev/null 2>&1 && ";
    for (const char *ca : {"ca", "evil"})
      script += std::string("openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=") + ca + " -keyout " + ca +
                ".key -out " + ca + ".pem && ";
    for (auto [leaf, ca] : {std::pair<const char *, const char *>{"a", "ca"}, {"b", "ca"}, {"stranger", "evil"}})
      script += std::string("openssl req -newkey rsa:2048 -nodes -subj /CN=") + leaf + " -keyout " + leaf +
                ".key -out " + leaf + ".csr && openssl x509 -req -in " + leaf + ".csr -CA " + ca + ".pem -CAkey " + ca +
                ".key -CAcreateserial -days 2 -out " + leaf + ".pem && ";
    script += "true";
    return std::system(script.c_str()) == 0 ? d : std::string();
  }();
  return dir;
}

std::map<AscendString, AscendString> WithTls(uint16_t port, const std::string &leaf, const std::string &ca = "ca") {
  auto o = ddtest::Options(port);
  const std::string d = MakeCerts();
  o[OPTION_DATADIST_TLS_CERT] = (d + "/" + leaf + ".pem").c_str();
  o[OPTION_DATADIST_TLS_KEY] = (d + "/" + leaf + ".key").c_str();
  o[OPTION_DATADIST_TLS_CA] = (d + "/" + ca + ".pem").c_str();
  return o;
}

#define NEEDS_TLS()                                                                     \
  do {                                                                                  \
    if (!datadist::tls::Available()) GTEST_SKIP() << "built without OpenSSL";           \
    if (MakeCerts().empty()) GTEST_SKIP() << "no openssl command to make certificates"; \
  } while (0)

TEST(Tls, LinksPullsAndIsPushedToOverMutualTls) {
  NEEDS_TLS();
  const uint16_t port = ddtest::FreePort();
  HostCache src(2, {4, 16}), dst(2, {4, 16});
  LlmDataDist owner(1, LlmRole::kPrompt), decoder(2, LlmRole::kDecoder);
  ASSERT_EQ(owner.Initialize(WithTls(port, "a")), LLM_SUCCESS);
  ASSERT_EQ(decoder.Initialize(WithTls(0, "b")), LLM_SUCCESS);
  ASSERT_EQ(src.Register(owner), LLM_SUCCESS);
  ASSERT_EQ(dst.Register(decoder), LLM_SUCCESS);
  src.Fill(3);
  std::vector<Status> rets;
  ASSERT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(1, port)}, rets, 5000), LLM_SUCCESS);
  ASSERT_EQ(decoder.PullKvCache(Index(1, 1, 2), dst.cache, 1), LLM_SUCCESS);
  for (int t = 0; t < 2; ++t) EXPECT_EQ(std::memcmp(dst.T(t) + 16, src.T(t) + 32, 16), 0);
  // the owner pushes over the decoder's reverse channel, inside the same TLS
  src.Fill(4);
  ASSERT_EQ(owner.PushKvBlocks(src.cache, Index(2, 1), {0}, {3}), LLM_SUCCESS);
  for (int t = 0; t < 2; ++t) EXPECT_EQ(std::memcmp(dst.T(t) + 48, src.T(t), 16), 0);
}

TEST(Tls, APeerAnotherCaSignedOrWithoutTlsIsRefused) {
  NEEDS_TLS();
  const uint16_t port = ddtest::FreePort(), plain_port = ddtest::FreePort();
  LlmDataDist owner(1, LlmRole::kPrompt), plain_owner(3, LlmRole::kPrompt);
  ASSERT_EQ(owner.Initialize(WithTls(port, "a")), LLM_SUCCESS);
  ASSERT_EQ(plain_owner.Initialize(ddtest::Options(plain_port)), LLM_SUCCESS);
  std::vector<Status> rets;
  {
    LlmDataDist stranger(2, LlmRole::kDecoder);  // its certificate: the wrong CA's
    ASSERT_EQ(stranger.Initialize(WithTls(0, "stranger", "ca")), LLM_SUCCESS);
    EXPECT_EQ(stranger.LinkLlmClusters({ddtest::Cluster(1, port)}, rets, 3000), LLM_LINK_FAILED);
  }
  {
    LlmDataDist trusting_evil(2, LlmRole::kDecoder);  // a good certificate, but trusts only evil
    ASSERT_EQ(trusting_evil.Initialize(WithTls(0, "b", "evil")), LLM_SUCCESS);
    EXPECT_EQ(trusting_evil.LinkLlmClusters({ddtest::Cluster(1, port)}, rets, 3000), LLM_LINK_FAILED);
  }
  {
    LlmDataDist plain(2, LlmRole::kDecoder);
    ASSERT_EQ(plain.Initialize(ddtest::Options()), LLM_SUCCESS);
    EXPECT_EQ(plain.LinkLlmClusters({ddtest::Cluster(1, port)}, rets, 3000), LLM_LINK_FAILED);
    // The owner dropped a plain HELLO: the failure asks whether it requires TLS, as Python's does.
    const std::string why = plain.LastLinkFailure(1).GetString();
    EXPECT_NE(why.find("during the handshake (does it require TLS?)"), std::string::npos) << why;
  }
  {
    LlmDataDist tls(2, LlmRole::kDecoder);
    ASSERT_EQ(tls.Initialize(WithTls(0, "b")), LLM_SUCCESS);
    EXPECT_EQ(tls.LinkLlmClusters({ddtest::Cluster(3, plain_port)}, rets, 3000), LLM_LINK_FAILED);
    EXPECT_EQ(tls.LinkLlmClusters({ddtest::Cluster(1, port)}, rets, 3000), LLM_SUCCESS);  // and the right one links
  }
}

TEST(Tls, OptionsAreCheckedAtInitialize) {
  const std::string d = MakeCerts();
  LlmDataDist dd(1, LlmRole::kDecoder);
  auto some = ddtest::Options();
  some[OPTION_DATADIST_TLS_CERT] = "/etc/hostname";
  EXPECT_EQ(dd.Initialize(some), LLM_PARAM_INVALID);  // some but not all
  auto missing = ddtest::Options();
  for (const char *k : {OPTION_DATADIST_TLS_CERT, OPTION_DATADIST_TLS_KEY, OPTION_DATADIST_TLS_CA})
    missing[k] = "/nonexistent/datadist.pem";
  EXPECT_EQ(dd.Initialize(missing), LLM_PARAM_INVALID);
  if (!datadist::tls::Available()) {
    if (!d.empty()) {
      EXPECT_EQ(dd.Initialize(WithTls(0, "a")), LLM_FEATURE_NOT_ENABLED);
    }
    return;
  }
  if (d.empty()) GTEST_SKIP() << "no openssl command to make certificates";
  auto not_pem = WithTls(0, "a");
  not_pem[OPTION_DATADIST_TLS_CA] = (d + "/a.csr").c_str();  // a file, but no CA certificate
  EXPECT_EQ(dd.Initialize(not_pem), LLM_PARAM_INVALID);
  auto wrong_key = WithTls(0, "a");
  wrong_key[OPTION_DATADIST_TLS_KEY] = (d + "/b.key").c_str();  // not the certificate's key
  EXPECT_EQ(dd.Initialize(wrong_key), LLM_PARAM_INVALID);
  EXPECT_EQ(dd.Initialize(WithTls(0, "a")), LLM_SUCCESS);
}

TEST(Tls, ClientsThatStallMidHandshakeHoldNoThread) {
  NEEDS_TLS();
  const uint16_t port = ddtest::FreePort();
  HostCache src(1, {4, 16}), dst(1, {4, 16});
  LlmDataDist owner(1, LlmRole::kPrompt), decoder(2, LlmRole::kDecoder);
  ASSERT_EQ(owner.Initialize(WithTls(port, "a")), LLM_SUCCESS);
  ASSERT_EQ(decoder.Initialize(WithTls(0, "b")), LLM_SUCCESS);
  ASSERT_EQ(src.Register(owner), LLM_SUCCESS);
  ASSERT_EQ(dst.Register(decoder), LLM_SUCCESS);
  src.Fill(5);
  // More stalled clients than the pool has threads (8 at most): each sends the start of a
  // ClientHello record (its header and a few bytes of a 512-byte body) and nothing more.
  std::vector<int> stalled;
  for (int i = 0; i < 12; ++i) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof(a)), 0);
    const uint8_t part[] = {0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03};
    ASSERT_EQ(send(fd, part, sizeof part, 0), static_cast<ssize_t>(sizeof part));
    stalled.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Status> rets;
  ASSERT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(1, port)}, rets, 3000), LLM_SUCCESS);
  ASSERT_EQ(decoder.PullKvCache(Index(1, 1, 1), dst.cache, 0), LLM_SUCCESS);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  EXPECT_EQ(std::memcmp(dst.T(0), src.T(0) + 16, 16), 0);
  // and each is closed at the handshake's deadline (10 s), not kept
  for (int fd : stalled) {
    timeval tv{15, 0};
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char buf[64];
    EXPECT_LE(recv(fd, buf, sizeof buf, 0), 0);
    close(fd);
  }
}

}  // namespace

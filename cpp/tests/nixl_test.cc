// NIXL in the core (src/nixl.h) under the C++ API: the serving options (docs/cpp.md), the
// consent rules a C++ owner applies to every NIXL request (docs/security.md, "The NIXL path"),
// and, where NIXL's C API is at hand (DATADIST_NIXL_LIBRARY: tests/core/test_googletest.py passes the
// nixl-cu12 wheel's libnixl_capi.so), an owner that hands out its metadata and NIXL grants
// for checked spans only. Without the library those tests skip.
#include "nixl.h"

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "errors.h"
#include "net.h"
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

// ---- VRAM: device-placed caches whose memory CUDA places on a GPU are NIXL VRAM with their
// device id (as transport/nixl.py's memory_kind). No GPU here: a CUDA runtime stand-in
// (tests/fake_cudart.cc, built beside this test) says which addresses are a device's.

/// The stand-in, loaded as the core's CUDA runtime (DATADIST_CUDART_LIBRARY) for the test's
/// life: `Place` makes [start, end) memory of `device`, `Calls` counts the core's questions.
class FakeCuda {
 public:
  FakeCuda() {
    const char *saved = std::getenv(datadist::nixl::kCudartEnv);
    had_ = saved != nullptr;
    if (had_) saved_ = saved;
    setenv(datadist::nixl::kCudartEnv, DATADIST_FAKE_CUDART, 1);
    lib_ = dlopen(DATADIST_FAKE_CUDART, RTLD_NOW | RTLD_LOCAL);  // the handle the core gets too
    if (lib_ == nullptr) return;
    set_ = reinterpret_cast<void (*)(uintptr_t, uintptr_t, int, int)>(dlsym(lib_, "fake_cudart_set"));
    calls_ = reinterpret_cast<long (*)()>(dlsym(lib_, "fake_cudart_calls"));
  }
  ~FakeCuda() {
    if (had_) {
      setenv(datadist::nixl::kCudartEnv, saved_.c_str(), 1);
    } else {
      unsetenv(datadist::nixl::kCudartEnv);
    }
    if (lib_) dlclose(lib_);
  }
  bool ok() const { return set_ && calls_; }
  void Place(const void *start, size_t n, int device, int type = 2) {
    set_(reinterpret_cast<uintptr_t>(start), reinterpret_cast<uintptr_t>(start) + n, device, type);
  }
  long Calls() const { return calls_(); }

 private:
  void *lib_ = nullptr;
  void (*set_)(uintptr_t, uintptr_t, int, int) = nullptr;
  long (*calls_)() = nullptr;
  bool had_ = false;
  std::string saved_;
};

// Only device-placed caches are asked of CUDA; device or managed memory on one device is VRAM
// with that device's id; host memory, or no CUDA runtime, is DRAM; a cache that is partly on a
// GPU, or on two, cannot be one registration. Before: the core registered everything as DRAM
// and asked nothing (core/native.py kept NIXL on the Python engine where CUDA saw a GPU).
TEST(NixlVram, OnlyDevicePlacedCachesAreAskedOfCuda) {
  FakeCuda cuda;
  ASSERT_TRUE(cuda.ok()) << DATADIST_FAKE_CUDART;
  std::vector<uint8_t> gpu(256), host(64);
  const std::vector<uint64_t> on_gpu = {reinterpret_cast<uint64_t>(gpu.data()), reinterpret_cast<uint64_t>(&gpu[128])};
  const std::vector<uint64_t> in_host = {reinterpret_cast<uint64_t>(host.data())};
  namespace nx = datadist::nixl;
  cuda.Place(gpu.data(), gpu.size(), 3);
  const nx::MemKind dram{w::kMemDram, 0}, vram3{w::kMemVram, 3};
  EXPECT_EQ(nx::MemoryKind(on_gpu, false), dram);  // host placement: never asked
  EXPECT_EQ(cuda.Calls(), 0);
  EXPECT_EQ(nx::MemoryKind(on_gpu, true), vram3);
  EXPECT_EQ(cuda.Calls(), 2);  // each tensor
  EXPECT_EQ(nx::MemoryKind(in_host, true), dram);
  cuda.Place(gpu.data(), gpu.size(), 1, 3);  // managed memory counts as the device's
  EXPECT_EQ(nx::MemoryKind(on_gpu, true), (nx::MemKind{w::kMemVram, 1}));
  cuda.Place(gpu.data(), 128, 3);  // the second tensor in host memory
  try {
    nx::MemoryKind(on_gpu, true);
    ADD_FAILURE() << "a cache partly on a GPU was given one memory kind";
  } catch (const datadist::Error &e) {
    EXPECT_EQ(e.code(), LLM_FEATURE_NOT_ENABLED);
    EXPECT_NE(std::string(e.what()).find("partly in GPU memory"), std::string::npos) << e.what();
  }
  uint32_t dev = 7;
  setenv(nx::kCudartEnv, "/nonexistent/libcudart.so", 1);  // no CUDA runtime: DRAM
  EXPECT_FALSE(nx::CudaDevice(on_gpu[0], &dev));
  EXPECT_EQ(nx::MemoryKind(on_gpu, true), dram);
  EXPECT_EQ(dev, 7U);
}

/// Two tensors of `bytes` each, at `at` and `at + bytes`, registered with `placement`.
Cache Carved(uint8_t *at, uint64_t bytes, CachePlacement placement) {
  Cache c;
  c.cache_desc.placement = placement;
  c.cache_desc.num_tensors = 2;
  c.cache_desc.data_type = DT_UINT8;
  c.cache_desc.shape = {4, static_cast<int64_t>(bytes / 4)};
  c.tensor_addrs = {reinterpret_cast<uintptr_t>(at), reinterpret_cast<uintptr_t>(at + bytes)};
  return c;
}

// The placement a C++ caller gives (CacheDesc::placement) reaches the core's NIXL: a decoder
// forced to NIXL registers the device-placed cache it pulls into as VRAM of the device CUDA
// names, and so does an owner with the cache it serves; a host-placed cache at such an address
// stays DRAM, unasked. Here NIXL's UCX has no CUDA support and refuses the VRAM registrations:
// the decoder then cannot pull into its device cache, and the owner grants none of its own
// (what a GPU host checks instead: examples/nixl/gpu_check.py). Before: every cache was DRAM,
// pulled into and granted alike. (A failed VRAM registration also leaves NIXL 1.5.1's agent
// with metadata no peer can load: the owner's comes last here, after the decoder linked.)
TEST_F(Serving, DevicePlacedCachesOnAGpuAreRegisteredAsVram) {
  FakeCuda cuda;
  ASSERT_TRUE(cuda.ok());
  constexpr uint64_t kBytes = 64;
  std::vector<uint8_t> arena(8 * kBytes, 5);
  cuda.Place(arena.data(), arena.size(), 3);
  Cache host = Carved(arena.data() + 2 * kBytes, kBytes, CachePlacement::kHost);
  ASSERT_EQ(
      prompt.RegisterKvCache(host.cache_desc, {host.tensor_addrs.begin(), host.tensor_addrs.end()}, {}, host.cache_id),
      LLM_SUCCESS);

  LlmDataDist decoder(2, LlmRole::kDecoder);
  auto options = ddtest::Options();
  options[AscendString("datadist.Transport")] = AscendString("nixl");
  options[AscendString(OPTION_DATADIST_NIXL_WHOLE_PROCESS)] = AscendString("1");
  options[AscendString(OPTION_DATADIST_NIXL_LIBRARY)] = AscendString(NixlLibrary());
  ASSERT_EQ(decoder.Initialize(options), LLM_SUCCESS);  // its agent is made here
  Cache into_gpu = Carved(arena.data() + 4 * kBytes, kBytes, CachePlacement::kDevice);
  Cache into_host = Carved(arena.data() + 6 * kBytes, kBytes, CachePlacement::kHost);
  ASSERT_EQ(decoder.RegisterKvCache(into_gpu.cache_desc, {into_gpu.tensor_addrs.begin(), into_gpu.tensor_addrs.end()},
                                    {}, into_gpu.cache_id),
            LLM_SUCCESS);
  ASSERT_EQ(
      decoder.RegisterKvCache(into_host.cache_desc, {into_host.tensor_addrs.begin(), into_host.tensor_addrs.end()}, {},
                              into_host.cache_id),
      LLM_SUCCESS);
  EXPECT_EQ(cuda.Calls(), 2);  // the decoder's device cache's two tensors, nothing else
  std::vector<Status> rets;
  ASSERT_EQ(decoder.LinkLlmClusters({ddtest::Cluster(1, port)}, rets, 3000), LLM_SUCCESS);
  for (uint8_t &b : arena) b = 0;
  for (size_t i = 2 * kBytes; i < 4 * kBytes; ++i) arena[i] = static_cast<uint8_t>(i * 7);
  ASSERT_EQ(decoder.PullKvCache(ddtest::Index(1, host.cache_id), into_host, 0), LLM_SUCCESS);
  for (size_t t = 0; t < 2; ++t)  // batch slot 0 (16 bytes) of each tensor
    EXPECT_EQ(std::memcmp(&arena[(6 + t) * kBytes], &arena[(2 + t) * kBytes], 16), 0) << t;
  EXPECT_EQ(decoder.PullKvCache(ddtest::Index(1, host.cache_id), into_gpu, 0), LLM_PARAM_INVALID);
  decoder.Finalize();

  // The owner's side: a device cache filed once its agent is up (the decoder's link made it).
  Cache gpu = Carved(arena.data(), kBytes, CachePlacement::kDevice);
  ASSERT_EQ(
      prompt.RegisterKvCache(gpu.cache_desc, {gpu.tensor_addrs.begin(), gpu.tensor_addrs.end()}, {}, gpu.cache_id),
      LLM_SUCCESS);
  EXPECT_EQ(cuda.Calls(), 4);
  Raw raw(port);
  ExpectRefused(raw, raw.Read(w::kCacheId, static_cast<uint64_t>(gpu.cache_id), 0, 0, 8), LLM_FEATURE_NOT_ENABLED,
                "not registered with NIXL");
  ASSERT_EQ(raw.Read(w::kCacheId, static_cast<uint64_t>(host.cache_id), 1, 0, 8).type, w::kNixlGrant);
  const w::NixlGrant g = w::DecodeNixlGrant(raw.payload);
  EXPECT_EQ(g.mem, w::kMemDram);
  EXPECT_EQ(g.device, 0U);
  raw.Send(w::EncodeRelease({g.lease_id, true}, raw.next_rid()));
}

}  // namespace

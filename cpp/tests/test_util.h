// Helpers for the C++ unit tests: host caches, free ports, deterministic bytes.
#ifndef DATADIST_CPP_TESTS_TEST_UTIL_H_
#define DATADIST_CPP_TESTS_TEST_UTIL_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "llm_datadist/llm_datadist.h"

namespace ddtest {

using namespace llm_datadist;

/// Seconds since `since` (steady clock).
inline double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

inline uint16_t FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr *>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

/// A free port on the IPv6 loopback, or 0 where the host has none (the caller skips).
inline uint16_t FreePort6() {
  int fd = socket(AF_INET6, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  socklen_t len = sizeof(a);
  const bool ok = bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof(a)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr *>(&a), &len) == 0;
  close(fd);
  return ok ? ntohs(a.sin6_port) : 0;
}

inline std::map<AscendString, AscendString> Options(uint16_t listen_port = 0, const char *sync_ms = "2000") {
  std::map<AscendString, AscendString> o;
  o[OPTION_DEVICE_ID] = "0";
  o[OPTION_SYNC_CACHE_WAIT_TIME] = sync_ms;
  if (listen_port) o[OPTION_LISTEN_IP_INFO] = ("127.0.0.1:" + std::to_string(listen_port)).c_str();
  return o;
}

/// A cache in ordinary host memory: num_tensors tensors of shape, DT_UINT8 unless told.
struct HostCache {
  HostCache(uint32_t num_tensors, std::vector<int64_t> shape, DataType dt = DT_UINT8, uint64_t item = 1) {
    desc.placement = CachePlacement::kHost;
    desc.num_tensors = num_tensors;
    desc.data_type = dt;
    desc.shape = shape;
    bytes = item;
    for (int64_t d : shape) bytes *= static_cast<uint64_t>(d);
    for (uint32_t i = 0; i < num_tensors; ++i) {
      mem.emplace_back(new uint8_t[bytes]());
      addrs.push_back(reinterpret_cast<uint64_t>(mem.back().get()));
    }
  }
  Status Register(LlmDataDist &dd) {
    Status s = dd.RegisterKvCache(desc, addrs, {}, cache.cache_id);
    cache.cache_desc = desc;
    cache.tensor_addrs.assign(addrs.begin(), addrs.end());
    return s;
  }
  uint8_t *T(size_t i) { return mem[i].get(); }
  void Fill(uint32_t seed) {
    for (size_t t = 0; t < mem.size(); ++t)
      for (uint64_t i = 0; i < bytes; ++i) mem[t][i] = Byte(seed, t, i);
  }
  static uint8_t Byte(uint32_t seed, size_t t, uint64_t i) {
    uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ULL ^ (t * 0x100000001B3ULL) ^ (i * 0xC2B2AE3D27D4EB4FULL);
    x ^= x >> 29;
    return static_cast<uint8_t>(x * 0xBF58476D1CE4E5B9ULL >> 56);
  }
  CacheDesc desc{};
  Cache cache{};
  uint64_t bytes = 0;
  std::vector<std::unique_ptr<uint8_t[]>> mem;
  std::vector<uint64_t> addrs;
};

inline CacheIndex Index(uint64_t cluster, int64_t cache_id, uint32_t batch = 0) {
  CacheIndex i{};
  i.cluster_id = cluster;
  i.cache_id = cache_id;
  i.batch_index = batch;
  return i;
}

inline ClusterInfo Cluster(uint64_t id, uint16_t port, const char *host = "127.0.0.1") {
  ClusterInfo c{};
  c.remote_cluster_id = id;
  IpInfo ip{};
  ip.ip = host;
  ip.port = port;
  c.remote_ip_infos.push_back(ip);
  return c;
}

inline KvCacheExtParam Ext(std::pair<int32_t, int32_t> src, std::pair<int32_t, int32_t> dst, uint8_t n = 2) {
  KvCacheExtParam e{};
  e.src_layer_range = src;
  e.dst_layer_range = dst;
  e.tensor_num_per_layer = n;
  return e;
}

}  // namespace ddtest

#endif  // DATADIST_CPP_TESTS_TEST_UTIL_H_

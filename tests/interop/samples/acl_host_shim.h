// Host-memory stand-ins for the few Ascend runtime (acl) calls CANN's C++ samples make, so the
// ports in this folder keep those calls where the originals have them. Device memory becomes
// malloc'ed host memory, filled with 0xA5 (device memory is not zeroed either, and a byte never
// written stays recognisable); device copies become memcpy; there is no recent error message.
// With DD_SAMPLE_DUMP_DIR set, every buffer is written to <dir>/buf<N>.bin (N: allocation order)
// when freed, or at exit if the sample never frees it, for the test to check every byte.
// The sample ports also read their ports from the environment (the originals hard-code 26000..26003):
// DD_PROMPT_PORT, DD_DECODER_PORT, DD_PROMPT_CONTROL_PORT, DD_DECODER_CONTROL_PORT.
#ifndef DATADIST_TESTS_SAMPLES_ACL_HOST_SHIM_H_
#define DATADIST_TESTS_SAMPLES_ACL_HOST_SHIM_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <map>
#include <string>
#include <utility>

using aclError = int;
constexpr aclError ACL_ERROR_NONE = 0;
constexpr aclError ACL_ERROR_BAD_ALLOC = 200000;
enum aclrtMemMallocPolicy { ACL_MEM_MALLOC_HUGE_FIRST, ACL_MEM_MALLOC_HUGE_ONLY, ACL_MEM_MALLOC_NORMAL_ONLY };
enum aclrtMemcpyKind { ACL_MEMCPY_HOST_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST,
                       ACL_MEMCPY_DEVICE_TO_DEVICE };

namespace acl_shim {
// Live buffers: address -> (allocation number, size). Never destroyed (read at exit).
inline std::map<void *, std::pair<int, size_t>> &Live() {
  static auto *live = new std::map<void *, std::pair<int, size_t>>();
  return *live;
}
inline void Dump(void *ptr, int n, size_t size) {
  const char *dir = std::getenv("DD_SAMPLE_DUMP_DIR");
  if (dir == nullptr || *dir == '\0') return;
  std::string path = std::string(dir) + "/buf" + std::to_string(n) + ".bin";
  if (FILE *f = std::fopen(path.c_str(), "wb")) {
    std::fwrite(ptr, 1, size, f);
    std::fclose(f);
  }
}
inline void DumpLeft() {
  for (auto &kv : Live()) Dump(kv.first, kv.second.first, kv.second.second);
}
}  // namespace acl_shim

inline aclError aclrtMalloc(void **ptr, size_t size, aclrtMemMallocPolicy) {
  static int count = 0;
  if (count == 0) std::atexit(acl_shim::DumpLeft);
  *ptr = std::malloc(size);
  if (*ptr == nullptr) return ACL_ERROR_BAD_ALLOC;
  std::memset(*ptr, 0xA5, size);
  acl_shim::Live()[*ptr] = {count++, size};
  return ACL_ERROR_NONE;
}
inline aclError aclrtFree(void *ptr) {
  auto it = acl_shim::Live().find(ptr);
  if (it != acl_shim::Live().end()) {
    acl_shim::Dump(ptr, it->second.first, it->second.second);
    acl_shim::Live().erase(it);
  }
  std::free(ptr);
  return ACL_ERROR_NONE;
}
inline aclError aclrtMemcpy(void *dst, size_t dst_max, const void *src, size_t count, aclrtMemcpyKind) {
  if (count > dst_max) return 100000;
  std::memcpy(dst, src, count);
  return ACL_ERROR_NONE;
}
inline const char *aclGetRecentErrMsg() { return nullptr; }

/// A port from the environment variable `name`, else `fallback` (the original's constant).
inline uint16_t PortFromEnv(const char *name, uint16_t fallback) {
  const char *v = std::getenv(name);
  return (v == nullptr || *v == '\0') ? fallback : static_cast<uint16_t>(std::stoul(v));
}

#endif  // DATADIST_TESTS_SAMPLES_ACL_HOST_SHIM_H_

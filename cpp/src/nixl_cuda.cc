#include <dirent.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <set>
#include <sstream>

#include "errors.h"
#include "metrics.h"
#include "nixl.h"
#include "verify.h"

namespace datadist {
namespace nixl {
namespace {

// ---- The CUDA runtime, asked where a device-placed cache's memory lies.
// cudaPointerAttributes since CUDA 11: {type, device,
// devicePointer, hostPointer}; type 2 is cudaMemoryTypeDevice, 3 cudaMemoryTypeManaged.
struct CudaPointerAttributes {
  int type;
  int device;
  void *device_pointer;
  void *host_pointer;
};
constexpr int kCudaDevice = 2, kCudaManaged = 3;
struct Cudart {
  int (*pointer_attributes)(CudaPointerAttributes *, const void *) = nullptr;
  int (*last_error)() = nullptr;
};

/// The runtime named by kCudartEnv, else the first of the usual sonames that loads; null where
/// none does. Loaded locally (RTLD_LOCAL: it never stands in for NIXL's own CUDA calls), once
/// per name, and kept.
const Cudart *CudaRuntime() {
  static std::mutex mu;
  static std::map<std::string, Cudart> loaded_by_name;  // a name that did not load: no function
  const char *env = std::getenv(kCudartEnv);
  const std::vector<std::string> names =
      env && *env ? std::vector<std::string>{env}
                  : std::vector<std::string>{"libcudart.so", "libcudart.so.12", "libcudart.so.13"};
  std::lock_guard<std::mutex> lock(mu);
  for (const std::string &name : names) {
    auto it = loaded_by_name.find(name);
    if (it == loaded_by_name.end()) {
      Cudart rt;
      if (void *lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) {
        rt.pointer_attributes =
            reinterpret_cast<decltype(rt.pointer_attributes)>(dlsym(lib, "cudaPointerGetAttributes"));
        rt.last_error = reinterpret_cast<decltype(rt.last_error)>(dlsym(lib, "cudaGetLastError"));
        if (!rt.pointer_attributes || !rt.last_error) {
          Log("the CUDA runtime " + name + " lacks cudaPointerGetAttributes: device caches are NIXL DRAM");
          rt = Cudart();
        }
      }
      it = loaded_by_name.emplace(name, rt).first;
    }
    if (it->second.pointer_attributes) return &it->second;
  }
  return nullptr;
}

}  // namespace

bool CudaDevice(uint64_t addr, uint32_t *device) {
  const Cudart *rt = CudaRuntime();
  if (rt == nullptr) return false;
  CudaPointerAttributes attrs{};
  if (rt->pointer_attributes(&attrs, reinterpret_cast<const void *>(static_cast<uintptr_t>(addr))) != 0) {
    rt->last_error();  // clears the error CUDA keeps for the thread
    return false;
  }
  if ((attrs.type != kCudaDevice && attrs.type != kCudaManaged) || attrs.device < 0) return false;
  *device = static_cast<uint32_t>(attrs.device);
  return true;
}

MemKind MemoryKind(const std::vector<uint64_t> &addrs, bool device_placed) {
  MemKind out;
  if (!device_placed || addrs.empty()) return out;
  size_t on_device = 0;
  for (size_t i = 0; i < addrs.size(); ++i) {
    uint32_t dev = 0;
    const bool gpu = CudaDevice(addrs[i], &dev);
    if (gpu && on_device && dev != out.device)
      Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED, "the cache's tensors lie on CUDA devices " +
                                                      std::to_string(out.device) + " and " + std::to_string(dev) +
                                                      ": one NIXL registration is on one device");
    if (gpu) {
      out.mem = wire::kMemVram;
      out.device = dev;
      ++on_device;
    }
  }
  if (on_device != 0 && on_device != addrs.size())
    Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED,
         "the cache's tensors lie partly in GPU memory, partly in host memory: one NIXL registration has one memory "
         "kind");
  return out;
}

}  // namespace nixl
}  // namespace datadist

// A stand-in for the CUDA runtime (libcudart), for tests on hosts without a GPU: it says that
// one chosen address range is device memory of one chosen device, everything else host memory,
// and counts the questions. The core loads it through DATADIST_CUDART_LIBRARY (src/nixl.h,
// kCudartEnv); the tests that do (cpp/tests/nixl_test.cc, tests/core/test_nixl_vram.py)
// set the range and read the count through fake_cudart_set / fake_cudart_calls. Only the
// fields and functions the core uses are modelled (cudaPointerAttributes of CUDA 11 and later).
#include <atomic>
#include <cstdint>

namespace {
struct Attributes {
  int type;  // cudaMemoryType: 0 unregistered, 1 host, 2 device, 3 managed
  int device;
  void *device_pointer;
  void *host_pointer;
};
std::atomic<uintptr_t> lo{0}, hi{0};
std::atomic<int> device{0}, type{2};
std::atomic<long> calls{0};
}  // namespace

extern "C" {

/// [start, end) is memory of `dev`, of cudaMemoryType `kind` (2 device, 3 managed); the count
/// starts again from 0.
void fake_cudart_set(uintptr_t start, uintptr_t end, int dev, int kind) {
  lo = start;
  hi = end;
  device = dev;
  type = kind;
  calls = 0;
}

/// cudaPointerGetAttributes calls since the last fake_cudart_set.
long fake_cudart_calls() { return calls; }

int cudaPointerGetAttributes(Attributes *a, const void *p) {
  ++calls;
  const uintptr_t x = reinterpret_cast<uintptr_t>(p);
  const bool in = x >= lo && x < hi;
  a->type = in ? type.load() : 0;
  a->device = in ? device.load() : -2;
  a->device_pointer = in ? const_cast<void *>(p) : nullptr;
  a->host_pointer = nullptr;
  return 0;  // cudaSuccess: CUDA 11 and later answer 0 for host memory too
}

int cudaGetDeviceCount(int *n) {
  *n = 1;
  return 0;
}

int cudaGetLastError() { return 0; }

}  // extern "C"

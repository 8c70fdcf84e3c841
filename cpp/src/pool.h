// Memory pools: the caches `allocate_cache` / `allocate_blocks_cache` (Python, mem_pool_cfg and
// host_mem_pool_cfg) and CANN's AllocateCache carve their memory from. A pool is one sealed memfd
// mapped shared (shm::Region: whole huge pages from one up, transparent huge pages asked for),
// so a same-host reader maps the very pages and copies with memcpy (SHM_GRANT, CACHE_LEASE);
// allocation is first fit over the free runs in whole pages (`1 << page_shift`, at least the
// OS page), so every allocation starts page-aligned.
//
// Who calls: the registry (Registry::Allocate files what it carves here) and the C++ face
// (a pool the size of each AllocateCache). An allocation is a handle (Pool::Allocation): its
// pages go back when the last copy of it is dropped, which the registry does once nothing holds
// the cache (no id, key, transfer or leased copy). The pool's mapping lives while the pool or
// any allocation does. Thread-safe; nothing blocks but on the pool's mutex.
#ifndef DATADIST_CPP_POOL_H_
#define DATADIST_CPP_POOL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "registry.h"
#include "shm.h"

namespace datadist {

class Pool : public std::enable_shared_from_this<Pool> {
 public:
  /// A pool of at least `size` bytes (rounded up to whole pages of `1 << page_shift`, at least
  /// the OS page) in a new sealed memfd named `name`. LLM_PARAM_INVALID for size 0 or a
  /// page_shift outside [10, 31); LLM_OUT_OF_MEMORY when it cannot be made or mapped.
  static std::shared_ptr<Pool> Create(const std::string &name, uint64_t size, uint32_t page_shift);
  Pool(const Pool &) = delete;
  Pool &operator=(const Pool &) = delete;

  /// What one allocation is: its address and where it lies in the pool's memfd. Its pages go
  /// back to the pool when the last shared_ptr to it is dropped.
  struct Allocation {
    uint64_t addr = 0;
    uint64_t offset = 0;  // in the memfd
    uint64_t bytes = 0;   // rounded up to pages
    std::shared_ptr<Pool> pool;
    ~Allocation();
  };

  /// `bytes` (> 0) rounded up to whole pages, first fit: the lowest free run that holds them.
  /// LLM_PARAM_INVALID for 0 bytes; LLM_OUT_OF_MEMORY when no free run is large enough (the
  /// message says how much was asked of how much). Never blocks.
  std::shared_ptr<Allocation> Allocate(uint64_t bytes);

  /// `num_tensors` tensors of `tensor_bytes` each, each starting on a page, in one allocation:
  /// the tensors' bases and where they lie in the memfd (for the registry's ShmPlace).
  /// LLM_OUT_OF_MEMORY as Allocate (or when the sizes overflow). Never blocks.
  std::shared_ptr<Allocation> AllocateTensors(uint32_t num_tensors, uint64_t tensor_bytes, std::vector<uint64_t> *addrs,
                                              ShmPlace *place);

  uint64_t size() const { return size_; }  // what the allocator hands out
  uint64_t page() const { return page_; }
  uint64_t used();  // bytes allocated now
  uint64_t base() const { return reinterpret_cast<uint64_t>(region_->addr()); }
  int fd() const { return region_->fd(); }
  uint64_t ino() const { return region_->ino(); }

 private:
  Pool(std::unique_ptr<shm::Region> region, uint64_t size, uint64_t page)
      : region_(std::move(region)), size_(size), page_(page) {
    free_[0] = size_;
  }
  void Free(uint64_t offset);
  std::unique_ptr<shm::Region> region_;
  const uint64_t size_, page_;
  std::mutex mu_;
  std::map<uint64_t, uint64_t> free_;  // offset -> bytes, no two adjacent
  std::map<uint64_t, uint64_t> used_;  // offset -> bytes
};

}  // namespace datadist

#endif  // DATADIST_CPP_POOL_H_

#include "pool.h"

#include <unistd.h>

#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "errors.h"

namespace datadist {

std::shared_ptr<Pool> Pool::Create(const std::string &name, uint64_t size, uint32_t page_shift) {
  if (page_shift < 10 || page_shift >= 31) Invalid("page_shift must be in [10, 31), got " + std::to_string(page_shift));
  if (size == 0) Invalid("a memory pool needs memory_size > 0");
  const uint64_t os_page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t page = (uint64_t{1} << page_shift) > os_page ? uint64_t{1} << page_shift : os_page;
  if (size > UINT64_MAX / 2)
    Fail(llm_datadist::LLM_OUT_OF_MEMORY, "cannot map a memory pool of " + std::to_string(size) + " bytes");
  const uint64_t rounded = (size + page - 1) / page * page;
  std::unique_ptr<shm::Region> region;
  try {
    region = shm::Region::Create(name.c_str(), rounded);
  } catch (const Error &e) {
    Fail(llm_datadist::LLM_OUT_OF_MEMORY,
         "cannot map a memory pool of " + std::to_string(size) + " bytes: " + e.what());
  }
  return std::shared_ptr<Pool>(new Pool(std::move(region), rounded, page));
}

Pool::Allocation::~Allocation() {
  if (pool) pool->Free(offset);
}

std::shared_ptr<Pool::Allocation> Pool::Allocate(uint64_t bytes) {
  if (bytes == 0) Invalid("cannot allocate 0 bytes");
  if (bytes > size_)
    Fail(llm_datadist::LLM_OUT_OF_MEMORY, "memory pool exhausted: " + std::to_string(bytes) +
                                              " bytes requested, pool of " + std::to_string(size_) + " bytes");
  const uint64_t need = (bytes + page_ - 1) / page_ * page_;
  auto a = std::make_shared<Allocation>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.begin();
    while (it != free_.end() && it->second < need) ++it;
    if (it == free_.end())
      Fail(llm_datadist::LLM_OUT_OF_MEMORY, "memory pool exhausted: " + std::to_string(bytes) +
                                                " bytes requested, pool of " + std::to_string(size_) + " bytes");
    const uint64_t at = it->first, have = it->second;
    free_.erase(it);
    if (have > need) free_[at + need] = have - need;
    used_[at] = need;
    a->offset = at;
  }
  a->addr = base() + a->offset;
  a->bytes = need;
  a->pool = shared_from_this();
  return a;
}

std::shared_ptr<Pool::Allocation> Pool::AllocateTensors(uint32_t num_tensors, uint64_t tensor_bytes,
                                                        std::vector<uint64_t> *addrs, ShmPlace *place) {
  const uint64_t step = (tensor_bytes + page_ - 1) / page_ * page_;
  if (step < tensor_bytes || (num_tensors && step > UINT64_MAX / num_tensors))
    Fail(llm_datadist::LLM_OUT_OF_MEMORY,
         "cannot allocate " + std::to_string(num_tensors) + " x " + std::to_string(tensor_bytes) + " bytes");
  auto a = Allocate(step * num_tensors);
  addrs->clear();
  *place = ShmPlace{};
  for (uint32_t i = 0; i < num_tensors; ++i) {
    addrs->push_back(a->addr + i * step);
    place->fds.push_back(fd());
    place->inos.push_back(ino());
    place->offsets.push_back(a->offset + i * step);
  }
  return a;
}

uint64_t Pool::used() {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t n = 0;
  for (const auto &u : used_) n += u.second;
  return n;
}

void Pool::Free(uint64_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  auto u = used_.find(offset);
  if (u == used_.end()) return;  // never: an Allocation frees once
  uint64_t at = offset, len = u->second;
  used_.erase(u);
  auto next = free_.lower_bound(at);
  if (next != free_.end() && at + len == next->first) {  // merge with the next free run
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {  // and with the previous one
    auto prev = std::prev(next);
    if (prev->first + prev->second == at) {
      prev->second += len;
      return;
    }
  }
  free_[at] = len;
}

}  // namespace datadist

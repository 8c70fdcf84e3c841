#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "errors.h"
#include "memfd.h"

#ifndef MADV_HUGEPAGE
#define MADV_HUGEPAGE 14
#endif

namespace datadist {
namespace shm {
namespace {

constexpr uint64_t kHugePage = 2 << 20;  // below it, no transparent huge page is asked for

// Ask for shmem transparent huge pages where the kernel offers them (shmem_enabled advise):
// a reader's view then maps the owner's huge pages whole. Never fails.
void AdviseHuge(void *addr, uint64_t size) {
  if (size >= kHugePage) madvise(addr, size, MADV_HUGEPAGE);
}

}  // namespace

bool Pays(size_t num_tensors, const std::vector<uint64_t> &lengths) {
  const uint64_t spans = static_cast<uint64_t>(num_tensors) * lengths.size();
  if (spans <= kMaxSpans) return true;
  uint64_t sum = 0;
  for (uint64_t n : lengths) sum += n;  // checked spans: each inside one tensor, no wrap
  return sum >= kMinSpanBytes * lengths.size();
}

Mapping::~Mapping() { munmap(const_cast<uint8_t *>(addr_), size_); }

MappingPtr Map(pid_t pid, int32_t fd, uint64_t ino, std::string &why) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int f = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // a FIFO cannot hang us
  if (f < 0) {
    why = "cannot open the owner's shared memory " + path + ": " + std::strerror(errno);
    return nullptr;
  }
  struct stat st {};
  std::string bad;
  if (fstat(f, &st) != 0) {
    why = "cannot stat " + path + ": " + std::strerror(errno);
  } else if (st.st_ino != ino || !S_ISREG(st.st_mode)) {
    bad = path + " is not the memory the owner named";
  } else {
    const int seals = fcntl(f, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK)) {  // not hostile per se (an older owner): do without
      why = path + " is not sealed against shrinking";
    } else if (st.st_size <= 0) {
      bad = path + " is empty";
    } else {
      const uint64_t size = static_cast<uint64_t>(st.st_size);
      void *m = mmap(nullptr, size, PROT_READ, MAP_SHARED, f, 0);
      if (m != MAP_FAILED) {
        close(f);
        AdviseHuge(m, size);
        return std::make_shared<const Mapping>(static_cast<const uint8_t *>(m), size, ino);
      }
      why = "cannot map " + path + ": " + std::strerror(errno);
    }
  }
  close(f);
  if (!bad.empty()) ProtocolViolation(bad);
  return nullptr;
}

bool Maps::Resolve(const std::vector<int32_t> &fds, const std::vector<uint64_t> &inos, std::vector<MappingPtr> &out,
                   std::string &why) {
  if (fds.size() != inos.size()) ProtocolViolation("shm grant arrays differ in length");
  std::map<int32_t, uint64_t> want;
  for (size_t i = 0; i < fds.size(); ++i) {
    auto got = want.emplace(fds[i], inos[i]);
    if (!got.second && got.first->second != inos[i])
      ProtocolViolation("shm grant names fd " + std::to_string(fds[i]) + " with two different files");
  }
  std::map<int32_t, MappingPtr> found;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto &w : want) {
      auto it = maps_.find(w.first);
      if (it != maps_.end() && it->second->ino() == w.second) found[w.first] = it->second;
    }
  }
  // The others are mapped outside the mutex (an open of /proc may take a while); a mapping
  // made here that another thread made meanwhile is just one more view, dropped below.
  std::map<int32_t, MappingPtr> made;
  for (const auto &w : want) {
    if (found.count(w.first)) continue;
    MappingPtr m = Map(pid_, w.first, w.second, why);  // throws for a lying owner: `made` unmaps
    if (!m) return false;
    made[w.first] = std::move(m);
  }
  {
    // Commit: a replaced mapping leaves the table; copies and leases holding it keep it mapped.
    std::lock_guard<std::mutex> lock(mu_);
    for (auto &m : made) maps_[m.first] = m.second;
  }
  found.insert(made.begin(), made.end());
  out.clear();
  out.reserve(fds.size());
  for (int32_t fd : fds) out.push_back(found[fd]);
  return true;
}

size_t Maps::size() {
  std::lock_guard<std::mutex> lock(mu_);
  return maps_.size();
}

std::vector<iovec> Spans(const std::vector<MappingPtr> &maps, const std::vector<uint64_t> &offsets,
                         const std::vector<uint64_t> &span_offsets, const std::vector<uint64_t> &span_lengths) {
  if (maps.size() != offsets.size()) ProtocolViolation("shm grant does not match the request");
  std::vector<iovec> src;
  src.reserve(maps.size() * span_offsets.size());
  for (size_t t = 0; t < maps.size(); ++t) {
    const uint64_t size = maps[t]->size(), base = offsets[t];
    if (base > size) ProtocolViolation("shm grant points outside the mapping");
    const uint64_t room = size - base;  // a lying peer must not make us read our own memory
    for (size_t i = 0; i < span_offsets.size(); ++i) {
      const uint64_t off = span_offsets[i], n = span_lengths[i];
      if (off > room || n > room - off) ProtocolViolation("shm grant spans run past the shared mapping");
      src.push_back({const_cast<uint8_t *>(maps[t]->addr() + base + off), static_cast<size_t>(n)});
    }
  }
  return src;
}

void Copy(const std::vector<iovec> &local, const std::vector<iovec> &src) {
  bool same = local.size() == src.size();
  for (size_t i = 0; same && i < local.size(); ++i) same = local[i].iov_len == src[i].iov_len;
  if (!same) Fail(llm_datadist::LLM_FAILED, "shared-memory copy: the plan's spans differ from the request's");
  for (size_t i = 0; i < local.size(); ++i) std::memcpy(local[i].iov_base, src[i].iov_base, local[i].iov_len);
}

std::unique_ptr<Region> Region::Create(const char *name, uint64_t size) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  if (size == 0 || size > (UINT64_MAX >> 1))
    Fail(llm_datadist::LLM_OUT_OF_MEMORY, "cannot make shared memory of " + std::to_string(size) + " bytes");
  const uint64_t unit = size >= kHugePage ? kHugePage : page;  // whole huge pages from one up (Python's round_size)
  size = (size + unit - 1) / unit * unit;
  const long fd = syscall(SYS_memfd_create, name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) Fail(llm_datadist::LLM_OUT_OF_MEMORY, std::string("memfd_create: ") + std::strerror(errno));
  const int f = static_cast<int>(fd);
  struct stat st {};
  void *m = MAP_FAILED;
  // Sealed at its size for good: a reader maps it, and a file shrunk under its mapping would
  // make its next copy fault (SIGBUS).
  if (ftruncate(f, static_cast<off_t>(size)) != 0 ||
      fcntl(f, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0 || fstat(f, &st) != 0 ||
      (m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0)) == MAP_FAILED) {
    const int err = errno;
    close(f);
    Fail(llm_datadist::LLM_OUT_OF_MEMORY,
         "cannot make shared memory of " + std::to_string(size) + " bytes: " + std::strerror(err));
  }
  AdviseHuge(m, size);
  return std::unique_ptr<Region>(new Region(static_cast<uint8_t *>(m), size, f, st.st_ino));
}

Region::~Region() {
  munmap(addr_, size_);
  close(fd_);
}

}  // namespace shm
}  // namespace datadist

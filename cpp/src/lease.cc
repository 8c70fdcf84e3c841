#include "lease.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

#include "errors.h"
#include "local.h"
#include "memfd.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434  // the same number on every architecture
#endif

namespace datadist {
namespace lease {
namespace {

// A full memory fence: loads and stores before it are ordered before those after it, the
// fence byte's included (the owner's revoke against a reader's lock-free copy, Copy). GCC
// refuses __atomic_thread_fence under ThreadSanitizer, which does not model fences: there a
// sequentially consistent read-modify-write of an atomic orders the same way (TSan builds
// only: tests, where a shared counter costs nothing that matters).
void FullFence() {
#if defined(__SANITIZE_THREAD__)
  static std::atomic<int> order{0};
  order.fetch_add(0, std::memory_order_seq_cst);
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

constexpr size_t kPage = 4096;  // the fence's size (Python: mmap.PAGESIZE; readers check >=)

}  // namespace

std::shared_ptr<OwnerProc> OwnerProc::Open(pid_t pid, std::string &why) {
  const long fd = syscall(SYS_pidfd_open, pid, 0);
  if (fd < 0) {
    why = std::string("pidfd_open: ") + std::strerror(errno);
    return nullptr;
  }
  return std::shared_ptr<OwnerProc>(new OwnerProc(pid, static_cast<int>(fd)));
}

OwnerProc::~OwnerProc() { close(pidfd_); }

bool OwnerProc::Exited() const {
  pollfd p{pidfd_, POLLIN, 0};
  return poll(&p, 1, 0) != 0;  // readable: exited; an error counts as exited too
}

std::unique_ptr<FenceView> FenceView::Open(pid_t pid, int32_t fd, uint64_t ino, std::string &why) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  int f = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (f < 0) {
    why = "cannot open the owner's fence " + path + ": " + std::strerror(errno);
    return nullptr;
  }
  struct stat st {};
  if (fstat(f, &st) != 0 || st.st_ino != ino || !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) < kPage) {
    why = path + " is not the fence the owner named";
  } else {
    const int seals = fcntl(f, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK)) {  // sealed: no SIGBUS under us
      why = path + " is not sealed against shrinking";
    } else {
      void *m = mmap(nullptr, kPage, PROT_READ, MAP_SHARED, f, 0);
      if (m != MAP_FAILED) return std::unique_ptr<FenceView>(new FenceView(f, static_cast<const uint8_t *>(m)));
      why = "cannot map " + path + ": " + std::strerror(errno);
    }
  }
  close(f);
  return nullptr;
}

FenceView::~FenceView() {
  munmap(const_cast<uint8_t *>(map_), kPage);
  close(fd_);  // drops our lock, if a copy left it (it does not)
}

bool FenceView::Enter() {
  std::lock_guard<std::mutex> lock(mu_);
  if (holders_ == 0 && flock(fd_, LOCK_SH | LOCK_NB) != 0) return false;  // the owner drains
  // Another process writes the byte: an atomic load (the lock's hand-over orders the owner's
  // store before it; while we hold the lock the owner cannot have drained).
  if (__atomic_load_n(map_, __ATOMIC_ACQUIRE) != 0) {
    if (holders_ == 0) flock(fd_, LOCK_UN);
    return false;
  }
  ++holders_;
  return true;
}

void FenceView::Leave() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--holders_ == 0) flock(fd_, LOCK_UN);
}

bool FenceView::Revoked() const { return __atomic_load_n(map_, __ATOMIC_ACQUIRE) != 0; }

// An owner that cannot make a fence now (out of descriptors or memory) cannot lease, but still
// serves requests: LLM_FEATURE_NOT_ENABLED tells the reader to ask per request (Link::Lease).
Fence::Fence() {
  fd_ = static_cast<int>(syscall(SYS_memfd_create, "datadist-fence", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (fd_ < 0)
    Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED,
         std::string("no fence for a cache lease: memfd_create: ") + std::strerror(errno));
  struct stat st {};
  void *m = MAP_FAILED;
  if (ftruncate(fd_, kPage) != 0 || fcntl(fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0 ||
      fstat(fd_, &st) != 0 || (m = mmap(nullptr, kPage, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0)) == MAP_FAILED) {
    const int err = errno;
    close(fd_);
    Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED, std::string("no fence for a cache lease: ") + std::strerror(err));
  }
  ino_ = st.st_ino;
  map_ = static_cast<uint8_t *>(m);
}

Fence::~Fence() {
  Revoke();  // readers keep their own descriptions: the flag stays set for them
  munmap(map_, kPage);
  close(fd_);
}

void Fence::Revoke() {
  std::lock_guard<std::mutex> lock(mu_);
  if (revoked_) return;
  __atomic_store_n(map_, static_cast<uint8_t>(1), __ATOMIC_RELEASE);
  // A full fence: the byte is visible before any later store of ours (or of a thread that
  // synchronizes with us) to the cache's memory. Readers that copy without the lock check the
  // byte after their copy (Copy): one that read a byte of the memory's next life sees the 1.
  FullFence();
  revoked_ = true;
}

bool Fence::revoked() const {
  std::lock_guard<std::mutex> lock(mu_);
  return revoked_;
}

bool Fence::Drained() {
  std::lock_guard<std::mutex> lock(mu_);
  if (flock(fd_, LOCK_EX | LOCK_NB) != 0) return false;
  flock(fd_, LOCK_UN);
  return true;
}

std::shared_ptr<Leased> Make(wire::CacheLease msg, uint64_t id, bool write, std::shared_ptr<OwnerProc> owner,
                             std::string &why, shm::Maps *maps, std::string *shm_why) {
  if (msg.addrs.size() > UINT32_MAX) ProtocolViolation("CACHE_LEASE names too many tensors");
  for (uint64_t a : msg.addrs)
    if (a == 0 || a + msg.tensor_bytes < a) ProtocolViolation("CACHE_LEASE names a tensor that wraps around");
  auto fence = FenceView::Open(owner->pid(), msg.fence_fd, msg.fence_ino, why);
  if (!fence) return nullptr;
  auto l = std::make_shared<Leased>();
  std::string no_shm;
  if (maps && !write && !msg.shm_fds.empty()) {
    if (maps->pid() != owner->pid()) Fail(llm_datadist::LLM_FAILED, "lease: the mappings are another process's");
    if (maps->Resolve(msg.shm_fds, msg.shm_inos, l->shm_maps, no_shm)) {
      for (size_t t = 0; t < l->shm_maps.size(); ++t) {
        const uint64_t size = l->shm_maps[t]->size(), off = msg.shm_offsets[t];
        if (off > size || size - off < msg.tensor_bytes)
          ProtocolViolation("cache lease: a tensor runs past its shared mapping");
      }
      l->shm_offsets = msg.shm_offsets;
    } else {
      l->shm_maps.clear();
      if (shm_why) *shm_why = no_shm;
    }
  }
  l->geo.num_tensors = static_cast<uint32_t>(msg.addrs.size());
  l->geo.tensor_bytes = msg.tensor_bytes;
  l->geo.units = msg.units;
  l->geo.unit_bytes = msg.tensor_bytes / msg.units;  // the decoder checked units > 0, no remainder
  l->geo.layout = msg.layout;
  l->msg = std::move(msg);
  l->id = id;
  l->write = write;
  l->owner = std::move(owner);
  l->fence = std::move(fence);
  return l;
}

Outcome Copy(Leased &l, const wire::Request &req, const std::vector<iovec> &local, std::string &why, bool cma_refused,
             bool *shm_used) {
  uint64_t base = 0;
  try {
    base = CheckRequest(l.geo, l.id, req);  // the owner's refusals, from here
  } catch (const Error &) {
    // Checked against a cache the key may no longer name (a model id bound anew): the owner
    // answers for the cache it names now.
    if (l.fence->Revoked()) return Outcome::kRevoked;
    throw;
  }
  const bool use_shm = !l.write && !l.shm_maps.empty() && (cma_refused || shm::Pays(req.tensors.size(), req.lengths));
  if (shm_used) *shm_used = use_shm;
  if (!use_shm && cma_refused) {
    why = "cross-memory attach refused, and the cache is not in shared memory";
    return Outcome::kRefused;
  }
  // The owner's spans, tensor-major as `local`: inside its tensors (checked above), so no
  // address wraps (Make checked every tensor's end).
  std::vector<iovec> remote;
  remote.reserve(local.size());
  for (uint32_t t : req.tensors)
    for (size_t i = 0; i < req.offsets.size(); ++i)
      remote.push_back(
          {reinterpret_cast<void *>(l.msg.addrs[t] + base + req.offsets[i]), static_cast<size_t>(req.lengths[i])});
  if (remote.size() != local.size()) Fail(llm_datadist::LLM_FAILED, "leased copy: the plan's spans differ");
  for (size_t i = 0; i < remote.size(); ++i)
    if (remote[i].iov_len != local[i].iov_len) Fail(llm_datadist::LLM_FAILED, "leased copy: the plan's spans differ");
  // A read by cross-memory attach takes no lock: it checks the fence before the copy and
  // again after it (a sequence lock). The owner writes the byte, with a full fence, before it
  // changes or lets go of the cache's memory (Fence::Revoke), so a copy that read any byte of
  // the memory's next life finds the byte set after it and is not reported done (kRevoked:
  // the owner's answer to a READ decides). Such a copy only ever lands in our own memory, and
  // process_vm_readv of memory the owner unmapped meanwhile fails (EFAULT) rather than faults.
  // Writes and reads by memcpy from our mapping of the owner's memfd (a SIGBUS if the owner
  // cut the file under it) keep the shared lock around the copy (the owner's drain waits for
  // them). Two system calls less a leased read (docs/performance.md, round 13).
  const bool validated = !l.write && !use_shm;
  if (validated) {
    if (l.fence->Revoked()) return Outcome::kRevoked;
  } else if (!l.fence->Enter()) {
    return Outcome::kRevoked;
  }
  // A write checks that the owner is still alive before the copy too (docs/protocol.md,
  // "Cache leases"): a pid that died may have been reused, and a write would land in that
  // other process. A read does not (issue 37: one poll less per leased read): an owner that
  // exited before the copy has exited after it too (its pidfd stays readable), so the check
  // after the copy fails the read (kFailed: what moved is not trusted, and it only ever
  // landed in our own memory).
  if (l.write && l.owner->Exited()) {
    l.fence->Leave();
    why = "the owner process " + std::to_string(l.owner->pid()) + " exited before the copy (nothing moved)";
    return Outcome::kFailed;
  }
  local::CopyResult got = local::CopyResult::kDone;
  if (use_shm) {
    // Our mapping of the owner's memfd: the same tensor bases, offset; the spans lie inside
    // the tensors (checked above) and the tensors inside their mappings (Make).
    std::vector<iovec> src;
    src.reserve(remote.size());
    size_t k = 0;
    for (uint32_t t : req.tensors)
      for (size_t i = 0; i < req.offsets.size(); ++i, ++k)
        src.push_back({const_cast<uint8_t *>(l.shm_maps[t]->addr() + l.shm_offsets[t] + base + req.offsets[i]),
                       remote[k].iov_len});
    shm::Copy(local, src);
  } else {
    got = local::VmCopy(l.owner->pid(), local, remote, l.write, why);
  }
  if (!validated) l.fence->Leave();
  if (got == local::CopyResult::kRefused) return Outcome::kRefused;  // nothing moved
  if (validated) {
    // The copy's loads come before this one (the owner's side: Fence::Revoke).
    FullFence();
    if (l.fence->Revoked()) {
      why = "the owner revoked the lease during the copy (what moved is not trusted)";
      return Outcome::kRevoked;
    }
  }
  if (l.owner->Exited()) {
    why = "the owner process " + std::to_string(l.owner->pid()) + " exited";
    return Outcome::kFailed;
  }
  return got == local::CopyResult::kDone ? Outcome::kDone : Outcome::kFailed;
}

}  // namespace lease
}  // namespace datadist

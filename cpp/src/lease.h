// Whole-cache leases on the local channel (docs/protocol.md, "Cache leases"): the only
// implementation, under both APIs.
//
// A reader holding a lease checks its own requests against the leased cache's geometry
// (CheckRequest, the owner's own checks) and copies with process_vm_readv / _writev, no frame
// sent. The owner's *fence file* (a sealed one-page memfd) says whether the lease holds:
//
// * reader: around every write, and every read by memcpy from a mapping of the owner's memfd,
//   a shared flock on its own open file description of the fence (opened through
//   /proc/<owner pid>/fd/<fd>), taken without blocking, and the file's first byte must be 0;
//   a read by process_vm_readv takes no lock: the byte must be 0 before the copy and still 0
//   after it (a sequence lock: what it read is not trusted otherwise). After the copy (and,
//   for a write, before it too) the owner's pidfd must not say it exited;
// * owner: writes 1 to the first byte, with a full fence (revoke), before the cache's memory
//   changes hands, then takes the exclusive lock without blocking, retried under a deadline
//   (drain): a locked copy in flight ends first, none starts after; an unlocked read in
//   flight finds the byte set after its copy.
//
// flock belongs to the open file description, shared by our threads: the reader counts its
// copies in flight and holds the shared lock while any runs (the first takes it, the last
// drops it).
#ifndef DATADIST_CPP_LEASE_H_
#define DATADIST_CPP_LEASE_H_

#include <sys/types.h>
#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "registry.h"
#include "shm.h"
#include "wire.h"

namespace datadist {
namespace lease {

/// The owner process of a link's local connection: its pid (SO_PEERCRED's) and a pidfd that
/// becomes readable when it exits (a copy from a pid that died may have read another
/// process's memory).
class OwnerProc {
 public:
  /// Null (with `why`) when the kernel has no pidfd_open: no leases.
  static std::shared_ptr<OwnerProc> Open(pid_t pid, std::string &why);
  ~OwnerProc();
  OwnerProc(const OwnerProc &) = delete;
  OwnerProc &operator=(const OwnerProc &) = delete;
  pid_t pid() const { return pid_; }
  bool Exited() const;

 private:
  OwnerProc(pid_t pid, int pidfd) : pid_(pid), pidfd_(pidfd) {}
  pid_t pid_;
  int pidfd_;
};

/// Reader side: the owner's fence file, opened anew and mapped read-only.
class FenceView {
 public:
  /// Null (with `why`) when /proc/<pid>/fd/<fd> cannot be opened, is not a regular file with
  /// inode `ino` of at least a page, is not sealed against shrinking, or cannot be mapped.
  static std::unique_ptr<FenceView> Open(pid_t pid, int32_t fd, uint64_t ino, std::string &why);
  ~FenceView();
  FenceView(const FenceView &) = delete;
  FenceView &operator=(const FenceView &) = delete;
  /// Before a copy: false when the lease is revoked (or being drained); true: copy, then Leave.
  bool Enter();
  void Leave();
  /// The owner revoked (a peek, no lock).
  bool Revoked() const;

 private:
  FenceView(int fd, const uint8_t *map) : fd_(fd), map_(map) {}
  int fd_;
  const uint8_t *map_;
  std::mutex mu_;
  int holders_ = 0;  // our copies in flight under the shared lock
};

/// Owner side: one fence file per leased cache. Thread-safe.
class Fence {
 public:
  /// LLM_FAILED when no sealed memfd can be made.
  Fence();
  ~Fence();
  Fence(const Fence &) = delete;
  Fence &operator=(const Fence &) = delete;
  int fd() const { return fd_; }
  uint64_t ino() const { return ino_; }
  /// No reader starts a copy under this fence from now on. Idempotent.
  void Revoke();
  bool revoked() const;
  /// No locked copy (a write, a read from a mapping of our memfds) is in flight (one
  /// non-blocking try of the exclusive lock); meaningful once revoked. A lock-free read in
  /// flight finds the byte set after its copy (Copy) and is not reported done.
  bool Drained();

 private:
  int fd_ = -1;
  uint64_t ino_ = 0;
  uint8_t *map_ = nullptr;
  mutable std::mutex mu_;
  bool revoked_ = false;
};

/// A lease the reader holds: the owner's answer, the geometry it implies, the fence.
struct Leased {
  wire::CacheLease msg;
  Geometry geo;
  uint64_t id = 0;  // what the key named: cache id (kind 2) or model id (kind 3)
  bool write = false;
  std::shared_ptr<OwnerProc> owner;
  std::unique_ptr<FenceView> fence;
  /// The cache in the owner's shareable memory (the answer had memfds, and we mapped them):
  /// each tensor's mapping, and its offset there. Empty: cross-memory attach only.
  std::vector<shm::MappingPtr> shm_maps;
  std::vector<uint64_t> shm_offsets;
  uint64_t seq = 0;  // its holder's order of leases (the oldest go first)
};

/// Builds a lease from the owner's answer; `why` and null when it is unusable here (the fence).
/// A CACHE_LEASE whose tensors would wrap the address space is a protocol violation. `maps`
/// (may be null: no shared memory): the connection's mappings of the owner, where the
/// answer's memfds are mapped; one that cannot be mapped here leaves the lease without
/// shared memory (`shm_why` says why); a tensor that runs past its memfd is a protocol
/// violation.
std::shared_ptr<Leased> Make(wire::CacheLease msg, uint64_t id, bool write, std::shared_ptr<OwnerProc> owner,
                             std::string &why, shm::Maps *maps = nullptr, std::string *shm_why = nullptr);

enum class Outcome {
  kDone,     // every byte moved
  kRevoked,  // not done: the owner revoked the lease (ask the owner); a lock-free read may have written `local`
  kRefused,  // nothing moved: the kernel refuses cross-memory attach to the owner
  kFailed,   // the owner exited, or the copy faulted: ask the owner (what moved is not trusted)
};

/// Checks `req` against the lease exactly as the owner would (LLM_PARAM_INVALID, thrown), then
/// copies between `local` (our spans, tensor-major as the request's) and the owner's spans
/// under the fence (locked; a read by process_vm_readv checked before and after the copy
/// instead: kRevoked when the owner revoked meanwhile, whatever moved): a read of a cache in
/// shared memory by memcpy from our mapping when that pays (shm::Pays) or `cma_refused`, else
/// with process_vm_readv (_writev). `shm_used`, when given, says which moved the bytes. With
/// `cma_refused`, a copy that would need cross-memory attach moves nothing (kRefused).
Outcome Copy(Leased &l, const wire::Request &req, const std::vector<iovec> &local, std::string &why,
             bool cma_refused = false, bool *shm_used = nullptr);

}  // namespace lease
}  // namespace datadist

#endif  // DATADIST_CPP_LEASE_H_

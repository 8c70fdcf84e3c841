// Shared memory on one host (docs/transports.md, "shm"; docs/protocol.md, "Pull on the same
// host"): the memfds Python's memory/pool.py (and the C++ API's AllocateCache) allocate.
//
// An owner whose cache lies in a sealed memfd (a pool the Python package allocated, an array
// from datadist.memory.shared_empty, or the C++ API's AllocateCache) answers a GRANT | SHM read
// with SHM_GRANT, and a LEASE_REQUEST with SHM with the memfds in its CACHE_LEASE: per tensor,
// the memfd's descriptor number in the owner, its inode and the offset of the tensor (unit
// base) in it. The reader opens /proc/<pid>/fd/<fd> (the pid the kernel reported for the local
// channel, never one a frame named), maps it read-only once per connection and copies with
// memcpy: no system call per span, no page pinning, no ptrace permission.
//
// What a lying owner cannot do to a reader (tests/security/test_same_host_trust.py, the spec):
// make it map a file that is not a regular file with the inode it named (a FIFO: opened
// non-blocking, refused), a file it could shrink under the copy (SIGBUS: F_SEAL_SHRINK
// required, else the reader uses cross-memory attach), an empty one, or read outside the file
// (every span must lie in its mapping); one grant naming one descriptor with two inodes is
// refused, and a mapping another grant replaced stays mapped while a copy uses it.
#ifndef DATADIST_CPP_SHM_H_
#define DATADIST_CPP_SHM_H_

#include <sys/types.h>
#include <sys/uio.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace datadist {
namespace shm {

/// Up to this many spans a request copies faster by memcpy from the owner's mapping whatever
/// their length; above it, when its spans average kMinSpanBytes or more (measured by
/// benchmarks/shm_vs_cma.py).
constexpr uint64_t kMaxSpans = 256;
constexpr uint64_t kMinSpanBytes = 32 << 10;

/// Whether a request of `num_tensors` tensors with spans `lengths` (each tensor's) copies
/// faster from shared memory than with process_vm_readv.
bool Pays(size_t num_tensors, const std::vector<uint64_t> &lengths);

/// One owner's memfd, mapped read-only here; unmapped when the last holder lets go (a copy in
/// flight holds it, so a grant that replaces it never unmaps it under that copy).
class Mapping {
 public:
  Mapping(const uint8_t *addr, uint64_t size, uint64_t ino) : addr_(addr), size_(size), ino_(ino) {}
  ~Mapping();
  Mapping(const Mapping &) = delete;
  Mapping &operator=(const Mapping &) = delete;
  const uint8_t *addr() const { return addr_; }
  uint64_t size() const { return size_; }
  uint64_t ino() const { return ino_; }

 private:
  const uint8_t *addr_;
  uint64_t size_;
  uint64_t ino_;
};
using MappingPtr = std::shared_ptr<const Mapping>;

/// Maps the owner's memfd `fd` (of process `pid`), which must be inode `ino`. Null with `why`
/// when it cannot be used here, which is not the owner's fault (no access to its /proc, not
/// sealed against shrinking: an older owner, mmap failing): read with cross-memory attach.
/// ProtocolViolation (thrown) when the file is not what the owner named: another inode, not a
/// regular file, empty. Never blocks (opened O_NONBLOCK).
MappingPtr Map(pid_t pid, int32_t fd, uint64_t ino, std::string &why);

/// A reader's mappings of one owner process, per connection: descriptor number -> mapping.
/// Thread-safe (a grant on the link's thread, leases on others).
class Maps {
 public:
  explicit Maps(pid_t pid) : pid_(pid) {}
  pid_t pid() const { return pid_; }
  /// The mappings of `fds[i]` / `inos[i]`, those held reused, the others mapped now (a held
  /// descriptor number with another inode: the owner reused the number for another file,
  /// which replaces the old mapping once every one of this call resolved). False with `why`
  /// when one cannot be mapped here (Map's null). ProtocolViolation for one descriptor named
  /// with two inodes, and Map's.
  bool Resolve(const std::vector<int32_t> &fds, const std::vector<uint64_t> &inos, std::vector<MappingPtr> &out,
               std::string &why);
  size_t size();

 private:
  pid_t pid_;
  std::mutex mu_;
  std::map<int32_t, MappingPtr> maps_;
};

/// Source spans of a read from shared memory: for requested tensor i, its unit base is
/// `maps[i]->addr() + offsets[i]` and its spans (`span_offsets` / `span_lengths`, the same in
/// every tensor) follow, tensor-major. ProtocolViolation when a base or a span lies outside
/// its mapping (overflow-safe). `maps`, `offsets`: one per requested tensor.
std::vector<iovec> Spans(const std::vector<MappingPtr> &maps, const std::vector<uint64_t> &offsets,
                         const std::vector<uint64_t> &span_offsets, const std::vector<uint64_t> &span_lengths);

/// memcpy of `src[i]` into `local[i]`; LLM_FAILED (nothing copied) unless entry i of both has
/// the same length.
void Copy(const std::vector<iovec> &local, const std::vector<iovec> &src);

/// Owner side: a new sealed memfd of `size` bytes (rounded up to whole pages), mapped shared
/// read-write, zeroed: memory a same-host reader can map. LLM_OUT_OF_MEMORY when it cannot
/// be made. Its descriptor stays open for as long as the region lives.
class Region {
 public:
  static std::unique_ptr<Region> Create(const char *name, uint64_t size);
  ~Region();
  Region(const Region &) = delete;
  Region &operator=(const Region &) = delete;
  uint8_t *addr() const { return addr_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }
  uint64_t ino() const { return ino_; }

 private:
  Region(uint8_t *addr, uint64_t size, int fd, uint64_t ino) : addr_(addr), size_(size), fd_(fd), ino_(ino) {}
  uint8_t *addr_;
  uint64_t size_;
  int fd_;
  uint64_t ino_;
};

}  // namespace shm
}  // namespace datadist

#endif  // DATADIST_CPP_SHM_H_

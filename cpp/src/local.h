// The same-host path (docs/protocol.md, "The local channel" and "Pull on the same host"):
//
// * the local channel: the same protocol over a unix socket bound to the abstract name
//   "\0datadist-v1.<pid>.<cluster_id>". The kernel decides "same host" (another host cannot
//   reach the name) and says who is on the other end (SO_PEERCRED): the pid a puller reads
//   is the one the kernel reported, never one a frame carried;
// * cross-memory attach: the puller copies the owner's granted spans with process_vm_readv;
//   a kernel refusal (EPERM, EACCES, ENOSYS) is reported as such, before any byte moved, so
//   the caller can fall back to streaming the bytes over the connection;
// * the ptrace permission: under Yama ptrace_scope=1 a process lets same-user readers attach
//   only with PR_SET_PTRACER_ANY, set at the first cross-memory-attach grant and undone when
//   the last server that set it stops.
#ifndef DATADIST_CPP_LOCAL_H_
#define DATADIST_CPP_LOCAL_H_

#include <sys/types.h>
#include <sys/uio.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "net.h"

namespace datadist {
namespace local {

/// What makes two processes "on the same host" for memory access, as they *say* it in
/// HELLO / WELCOME: /proc/sys/kernel/random/boot_id and the inode of /proc/self/ns/pid.
struct HostIdentity {
  std::array<uint8_t, 16> boot_id{};  // all zero when unknown
  uint64_t pid_ns = 0;
  static const HostIdentity &Current();
  /// A peer's boot id is ours (and ours is known): worth trying the local channel. A claim,
  /// not a proof.
  bool ClaimsSameHost(const std::array<uint8_t, 16> &peer_boot_id) const;
};

/// Who the kernel says is on the other end of a unix socket (pid 0: not visible from our
/// pid namespace).
struct Cred {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  /// The kernel would let this peer read our memory: the same uid, or root. Grants
  /// (addresses) go only to such peers.
  bool MayReadUs() const;
  /// We could read the peer's memory: the same uid, or we are root.
  bool WeMayRead() const;
};

/// SO_PEERCRED of a connected unix socket; LLM_LINK_FAILED if the kernel does not say.
Cred PeerCred(int fd);

/// "\0datadist-v1.<pid>.<cluster_id>": the abstract name (leading NUL, no trailing one).
std::string Name(uint64_t pid, uint64_t cluster_id);

/// A listening, non-blocking unix socket on the abstract `name`; -1 when the name is taken
/// (another process, or another instance of ours with the same cluster id): serve TCP only.
int Listen(const std::string &name);

/// Connects to the abstract `name` (immediate or refused): LLM_LINK_FAILED when nobody
/// serves it, LLM_TIMEOUT past the deadline.
std::unique_ptr<Conn> Connect(const std::string &name, Deadline deadline);

/// How a cross-memory copy ended.
enum class CopyResult {
  kDone,     // every byte moved
  kRefused,  // the kernel refused cross-memory attach (nothing to retry on this pid)
  kFailed,   // the process is gone (ESRCH), an address is not mapped there (EFAULT), or the
             // copy fell short twice: some bytes may have moved
};

/// Copies between our spans `local` and the spans `remote` of process `pid` (entry i of both
/// has the same length): process_vm_readv, or with `write` process_vm_writev, IOV_MAX
/// entries per call. Never throws for the kernel's answers: kRefused / kFailed with `why`.
CopyResult VmCopy(pid_t pid, const std::vector<iovec> &local, const std::vector<iovec> &remote, bool write,
                  std::string &why);

/// Copies the spans `remote` of process `pid` into `local` (entry i of both has the same
/// length), IOV_MAX entries per call. kRefused (with `why`) when the kernel refuses;
/// LLM_LINK_FAILED when the process is gone (ESRCH) or the copy falls short twice (the
/// owner's mapping went away).
CopyResult VmRead(pid_t pid, const std::vector<iovec> &local, const std::vector<iovec> &remote, std::string &why);

/// PR_SET_PTRACER_ANY while a user (a server that answered a cross-memory-attach grant)
/// needs it, only under Yama ptrace_scope=1. Process-wide, thread-safe.
class Ptracer {
 public:
  /// `user` needs same-host readers; the first user sets PR_SET_PTRACER_ANY.
  static void Acquire(const void *user);
  /// `user` is done; the last one undoes PR_SET_PTRACER_ANY.
  static void Release(const void *user);
  /// How many users hold it, and what was done (for tests and logs).
  static size_t Users();
  static std::string State();
};

}  // namespace local
}  // namespace datadist

#endif  // DATADIST_CPP_LOCAL_H_

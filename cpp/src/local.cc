#include "local.h"

#include <errno.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>

#include "errors.h"

#ifndef PR_SET_PTRACER
#define PR_SET_PTRACER 0x59616d61
#endif
#ifndef PR_SET_PTRACER_ANY
#define PR_SET_PTRACER_ANY (static_cast<unsigned long>(-1))
#endif

namespace datadist {
namespace local {
namespace {

constexpr size_t kIovMax = 1024;  // IOV_MAX on Linux

HostIdentity Read() {
  HostIdentity id;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string text;
  if (f >> text) {
    // "xxxxxxxx-xxxx-...": 32 hex digits, as Python's bytes.fromhex(text.replace("-", ""))
    std::string hex;
    for (char c : text)
      if (c != '-') hex.push_back(c);
    if (hex.size() == 32 && hex.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos)
      for (size_t i = 0; i < 16; ++i)
        id.boot_id[i] = static_cast<uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
  }
  struct stat st {};
  if (stat("/proc/self/ns/pid", &st) == 0) id.pid_ns = st.st_ino;
  return id;
}

sockaddr_un Address(const std::string &name, socklen_t &len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (name.size() > sizeof(a.sun_path)) Invalid("local channel name too long");
  std::memcpy(a.sun_path, name.data(), name.size());
  len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
  return a;
}

std::string Printable(const std::string &name) { return name.empty() ? name : name.substr(1); }

}  // namespace

const HostIdentity &HostIdentity::Current() {
  static const HostIdentity id = Read();
  return id;
}

bool HostIdentity::ClaimsSameHost(const std::array<uint8_t, 16> &peer_boot_id) const {
  const bool known = std::any_of(boot_id.begin(), boot_id.end(), [](uint8_t b) { return b != 0; });
  return known && boot_id == peer_boot_id;
}

bool Cred::MayReadUs() const { return pid > 0 && (uid == getuid() || uid == 0); }

bool Cred::WeMayRead() const { return pid > 0 && (getuid() == uid || getuid() == 0); }

Cred PeerCred(int fd) {
  ucred c{};
  socklen_t len = sizeof(c);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &c, &len) != 0 || len != sizeof(c))
    Fail(llm_datadist::LLM_LINK_FAILED, std::string("SO_PEERCRED: ") + std::strerror(errno));
  return Cred{c.pid, c.uid, c.gid};
}

std::string Name(uint64_t pid, uint64_t cluster_id) {
  return std::string(1, '\0') + "datadist-v1." + std::to_string(pid) + "." + std::to_string(cluster_id);
}

int Listen(const std::string &name) {
  socklen_t len = 0;
  sockaddr_un a = Address(name, len);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  if (bind(fd, reinterpret_cast<sockaddr *>(&a), len) != 0 || listen(fd, 128) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

std::unique_ptr<Conn> Connect(const std::string &name, Deadline deadline) {
  if (Clock::now() >= deadline) Fail(llm_datadist::LLM_TIMEOUT, "no time left for the local channel");
  socklen_t len = 0;
  sockaddr_un a = Address(name, len);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) Fail(llm_datadist::LLM_LINK_FAILED, std::string("socket: ") + std::strerror(errno));
  auto conn = std::make_unique<Conn>(fd, "local " + Printable(name));
  // A unix connect completes at once or fails (EAGAIN: the backlog is full; refused too).
  if (connect(fd, reinterpret_cast<sockaddr *>(&a), len) != 0)
    Fail(llm_datadist::LLM_LINK_FAILED, "no local channel " + Printable(name) + ": " + std::strerror(errno));
  return conn;
}

CopyResult VmCopy(pid_t pid, const std::vector<iovec> &local, const std::vector<iovec> &remote, bool write,
                  std::string &why) {
  if (local.size() != remote.size()) Fail(llm_datadist::LLM_FAILED, "cross-memory copy: span lists differ");
  const char *what = write ? "process_vm_writev" : "process_vm_readv";
  // One call; -1 when the kernel refused cross-memory attach, -2 when the copy failed
  // otherwise (`why` says how).
  auto call = [&](const iovec *l, size_t nl, const iovec *r, size_t nr) -> ssize_t {
    ssize_t got = write ? process_vm_writev(pid, l, nl, r, nr, 0) : process_vm_readv(pid, l, nl, r, nr, 0);
    if (got >= 0) return got;
    const int err = errno;
    if (err == EPERM || err == EACCES || err == ENOSYS) {
      why = std::string(what) + " refused: " + std::strerror(err);
      return -1;
    }
    why = err == ESRCH ? "the owner process " + std::to_string(pid) + " is gone"
                       : std::string("cross-memory copy failed: ") + std::strerror(err);
    return -2;
  };
  for (size_t start = 0; start < local.size(); start += kIovMax) {
    const size_t n = std::min(kIovMax, local.size() - start);
    size_t want = 0;
    for (size_t i = start; i < start + n; ++i) want += local[i].iov_len;
    ssize_t got = call(local.data() + start, n, remote.data() + start, n);
    if (got < 0) return got == -1 ? CopyResult::kRefused : CopyResult::kFailed;
    size_t done = static_cast<size_t>(got);
    if (done < want) {
      // A short copy: retry the rest once (the kernel may stop at a page boundary under
      // memory pressure); a second short copy is a fault (the owner's mapping went away).
      std::vector<iovec> l(local.begin() + start, local.begin() + start + n);
      std::vector<iovec> r(remote.begin() + start, remote.begin() + start + n);
      for (auto *v : {&l, &r}) {
        size_t skip = done, i = 0;
        while (i < v->size() && skip >= (*v)[i].iov_len) skip -= (*v)[i++].iov_len;
        v->erase(v->begin(), v->begin() + static_cast<std::ptrdiff_t>(i));
        if (!v->empty()) {
          v->front().iov_base = static_cast<uint8_t *>(v->front().iov_base) + skip;
          v->front().iov_len -= skip;
        }
      }
      got = call(l.data(), l.size(), r.data(), r.size());
      if (got < 0) return got == -1 ? CopyResult::kRefused : CopyResult::kFailed;
      done += static_cast<size_t>(got);
    }
    if (done != want) {
      why = "cross-memory copy moved " + std::to_string(done) + " of " + std::to_string(want) + " bytes";
      return CopyResult::kFailed;
    }
  }
  return CopyResult::kDone;
}

CopyResult VmRead(pid_t pid, const std::vector<iovec> &local, const std::vector<iovec> &remote, std::string &why) {
  CopyResult got = VmCopy(pid, local, remote, false, why);
  if (got == CopyResult::kFailed) Fail(llm_datadist::LLM_LINK_FAILED, why);
  return got;
}

namespace {

struct PtracerState {
  std::mutex mu;
  std::set<const void *> users;
  bool set = false;  // PR_SET_PTRACER_ANY is in force because of us
  std::string state = "not requested";
};

PtracerState &Ptrace() {
  static PtracerState s;
  return s;
}

std::string YamaScope() {
  std::ifstream f("/proc/sys/kernel/yama/ptrace_scope");
  std::string scope;
  if (!(f >> scope)) return "";
  return scope;
}

}  // namespace

void Ptracer::Acquire(const void *user) {
  PtracerState &s = Ptrace();
  std::lock_guard<std::mutex> lock(s.mu);
  const bool first = s.users.empty();
  s.users.insert(user);
  if (!first) return;
  const std::string scope = YamaScope();
  if (scope != "1") {
    s.state =
        scope.empty() ? "no Yama: cross-memory attach needs nothing" : "Yama ptrace_scope=" + scope + ": left as is";
    return;
  }
  if (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0) {
    s.state = std::string("Yama ptrace_scope=1: PR_SET_PTRACER_ANY refused (") + std::strerror(errno) + ")";
    return;
  }
  s.set = true;
  s.state = "Yama ptrace_scope=1: PR_SET_PTRACER_ANY set for cross-memory attach";
}

void Ptracer::Release(const void *user) {
  PtracerState &s = Ptrace();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.users.erase(user) || !s.users.empty() || !s.set) return;
  s.set = false;
  s.state = prctl(PR_SET_PTRACER, 0, 0, 0, 0) == 0
                ? "PR_SET_PTRACER_ANY undone"
                : std::string("undoing PR_SET_PTRACER_ANY failed: ") + std::strerror(errno);
}

size_t Ptracer::Users() {
  PtracerState &s = Ptrace();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.users.size();
}

std::string Ptracer::State() {
  PtracerState &s = Ptrace();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.state;
}

}  // namespace local
}  // namespace datadist

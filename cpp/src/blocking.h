// "About to block": a per-thread hook the core calls right before a wait that may last (a
// peer's bytes that have not come, a link another transfer holds), so that a caller which
// holds something while it expects a short call (the Python binding holds the interpreter's
// lock, cpp/python/gil.h) lets go of it only when the call really waits.
//
// Who installs: a face's calling thread, for one call (blocking::Scope); the Python binding
// for its transfers (cpp/python/module.cc, run and submit). The core's own threads (accept,
// I/O pool, workers) never install one, so for them every function here is a no-op.
// Who calls AboutToBlock / WaitBriefly: net.cc before poll() and before a bulk transfer turns
// blocking, link.cc before waiting for a link another transfer holds. Neither blocks beyond
// the hook's own budget (WaitBriefly) and neither takes a lock.
#ifndef DATADIST_CPP_BLOCKING_H_
#define DATADIST_CPP_BLOCKING_H_

#include <poll.h>

#include <chrono>
#include <ctime>

namespace datadist {
namespace blocking {

/// What a caller lets go of before its thread waits. `Blocking` runs at most once per
/// installation, on the installing thread, with no core lock held; it must not block or throw.
class Hook {
 public:
  virtual ~Hook() = default;
  virtual void Blocking() noexcept = 0;
  /// How long a wait may be waited out before Blocking runs (0: at once).
  std::chrono::microseconds budget{0};
};

namespace internal {
inline thread_local Hook *current = nullptr;
}  // namespace internal

/// True while this thread has a hook that has not run yet.
inline bool Pending() { return internal::current != nullptr; }

/// This thread is about to wait: the hook runs (once), then the wait may last.
inline void AboutToBlock() {
  Hook *h = internal::current;
  if (!h) return;
  internal::current = nullptr;  // first: a hook that waits itself must not run again
  h->Blocking();
}

/// Before a poll() on `fd` for `events` that would wait: with a pending hook, waits up to its
/// budget (less when `left_us` is less) in ppoll, the caller's hold kept. True when the socket
/// became ready within it (no hook ran); false after the hook ran (or with none), and the
/// caller waits as it would have.
inline bool WaitBriefly(int fd, short events, long long left_us) {
  Hook *h = internal::current;
  if (!h) return false;
  long long us = h->budget.count();
  if (left_us < us) us = left_us;
  if (us > 0) {
    pollfd p{fd, events, 0};
    timespec ts{static_cast<time_t>(us / 1000000), static_cast<long>(us % 1000000) * 1000};
    if (ppoll(&p, 1, &ts, nullptr) > 0) return true;  // a signal (EINTR) ends the budget too
  }
  AboutToBlock();
  return false;
}

/// Installs `hook` on this thread for the scope (the one before it is restored after).
class Scope {
 public:
  explicit Scope(Hook *hook) : prev_(internal::current) { internal::current = hook; }
  ~Scope() { internal::current = prev_; }
  Scope(const Scope &) = delete;
  Scope &operator=(const Scope &) = delete;

 private:
  Hook *prev_;
};

}  // namespace blocking
}  // namespace datadist

#endif  // DATADIST_CPP_BLOCKING_H_

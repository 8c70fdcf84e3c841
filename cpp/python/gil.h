// A bounded hold of the GIL around one call into the core (Engine.run, Engine.submit's inline
// copy): the calling thread keeps the interpreter's lock while the core works and gives it up
// only right before the core would really wait (cpp/src/blocking.h: a peer's answer not there
// after kWaitBudget, a link another transfer holds, a bulk transfer waiting in the kernel),
// then takes it back when the call returns. A call that never waits (a leased same-host copy)
// never hands the interpreter to another thread, and so never waits up to the switch interval
// (5 ms) to get it back from a busy one.
//
// Rules kept: the GIL is taken back only on the calling thread at the scope's end, with no core
// lock held (no core thread ever takes it); it is never held while waiting on a peer beyond
// kWaitBudget, nor across a copy of more than kHoldBytes (released at once for those).
// Who uses it: cpp/python/module.cc, with the GIL held on entry. Never blocks on its own.
#ifndef DATADIST_CPP_PYTHON_GIL_H_
#define DATADIST_CPP_PYTHON_GIL_H_

#include <Python.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "blocking.h"
#include "net.h"
#include "session.h"

namespace datadist_py {

/// Calls moving more than this many bytes release the GIL at once: their copy alone may take
/// longer than other Python threads should wait (1 MiB: ~0.1 ms at memory speed).
constexpr uint64_t kHoldBytes = 1 << 20;
/// How long a call may wait for a peer's bytes holding the GIL (asleep in ppoll) before it lets
/// go: a small TCP pull's answer comes in 20-60 us, and a wait that gave the GIL up made the
/// pull wait a whole switch interval (5 ms) to get it back whenever another Python thread was
/// busy. Measured on a quiet machine (docs/performance.md, round 9, "The busy interpreter over
/// TCP"): with 0 (round 8's choice, measured under heavy load) the 16 KiB TCP pull beside a
/// busy thread had a p50 of 5.2 ms in 4 runs of 6; with 1 ms its p50 was 27-36 us and its p99
/// 120-190 us, the idle pull unchanged (27-36 us). The cost: another Python thread waits up to
/// the budget per such call, as it waits for a leased copy's.
constexpr std::chrono::microseconds kWaitBudget{1000};

class GilHold final : public datadist::blocking::Hook {
 public:
  /// `bytes`: what the call moves (over kHoldBytes: released here).
  explicit GilHold(uint64_t bytes) : scope_(this) {
    budget = kWaitBudget;
    if (bytes > kHoldBytes) datadist::blocking::AboutToBlock();
  }
  ~GilHold() override {
    if (saved_) PyEval_RestoreThread(saved_);
  }
  GilHold(const GilHold &) = delete;
  GilHold &operator=(const GilHold &) = delete;
  void Blocking() noexcept override { saved_ = PyEval_SaveThread(); }
  /// Whether the call gave the GIL up (tests, the bench's counters).
  bool released() const { return saved_ != nullptr; }

 private:
  PyThreadState *saved_ = nullptr;
  datadist::blocking::Scope scope_;  // installs this hook for the call; uninstalled after
};

/// Waits for an issued transfer (Engine.submit's Handle.wait), which a core worker ends:
/// `ended_by(t)` waits until the transfer ended or `t` passed and says whether it ended. The
/// first kWaitBudget of the wait keeps the GIL, as GilHold's wait for a peer's answer does (an
/// issued 16 KiB TCP pull ends in 40-80 us; a waiter that let the GIL go at once waited up to a
/// switch interval, 5 ms, to get it back whenever another Python thread was busy); the rest of
/// it, to `deadline`, waits without the GIL. Holding is safe: what ends the transfer is a core
/// thread, which never takes the GIL (one that needs another Python thread, a proxy in Python,
/// gets it after the budget). Who calls: cpp/python/module.cc (Handle.wait), with the GIL
/// held; blocks up to `deadline`.
template <class EndedBy>
bool WaitHeldBriefly(std::chrono::steady_clock::time_point deadline, EndedBy &&ended_by) {
  const auto brief = std::min(deadline, std::chrono::steady_clock::now() + kWaitBudget);
  if (ended_by(brief)) return true;
  if (brief >= deadline) return false;
  struct Released {  // the GIL given up for the rest of the wait, taken back however it ends
    PyThreadState *saved = PyEval_SaveThread();
    ~Released() { PyEval_RestoreThread(saved); }
  } released;
  return ended_by(deadline);
}

/// Runs a prepared transfer as Engine.run does: its deadline `timeout_s` from now (0 when
/// negative), the GIL held as GilHold holds it. Who calls: cpp/python/module.cc (Engine.run)
/// and cpp/python/planned.h (a planned pull's hit), with the GIL held; blocks until the
/// transfer ends or the deadline passes.
inline void RunHeld(datadist::Session &core, const datadist::Call &call, double timeout_s) {
  const auto since = datadist::Clock::now();
  const datadist::Deadline deadline = datadist::After(timeout_s < 0 ? 0 : timeout_s);
  GilHold hold(call.bytes);  // released only where the core waits
  core.Run(call, deadline, since);
}

}  // namespace datadist_py

#endif  // DATADIST_CPP_PYTHON_GIL_H_

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

#include <chrono>
#include <cstdint>

#include "blocking.h"

namespace datadist_py {

/// Calls moving more than this many bytes release the GIL at once: their copy alone may take
/// longer than other Python threads should wait (1 MiB: ~0.1 ms at memory speed).
constexpr uint64_t kHoldBytes = 1 << 20;
/// How long a call may wait for a peer's bytes holding the GIL (asleep in ppoll) before it lets
/// go. 0: at the first wait. Measured (docs/performance.md, round 8): a budget of 200 or 1000 us
/// made every idle 16 KiB TCP pull 4-20 us slower (a sleep on a short timer costs that much
/// more to wake from than one on the deadline, in this VM), and did not lower the busy p99,
/// which the interpreter's own forced switches set; a same-host leased pull, which never waits,
/// keeps the GIL whatever the budget.
constexpr std::chrono::microseconds kWaitBudget{0};

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

}  // namespace datadist_py

#endif  // DATADIST_CPP_PYTHON_GIL_H_

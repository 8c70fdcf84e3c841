// The I/O threads: a fixed set of threads serves any number of connections, so a process with
// a thousand links holds no more threads than one with a few.
//
// No pool thread ever waits on a peer's bytes. A connection is a task with its own state (what
// it has read of a frame, what it has still to send: server.cc's Stream); between the steps
// it takes, it is *parked*: its socket sits in one epoll set, armed for one event
// (EPOLLONESHOT) of the kind the task asks for (Task::Interest: EPOLLIN to read its peer's
// next bytes, EPOLLOUT to send more of an answer), and no thread waits on it. Every pool
// thread waits in epoll_wait on that set; the one the kernel wakes for a ready socket (or
// EOF, or an error) runs one step of exactly that task (Task::Run): it moves what the socket
// gives or takes now, non-blocking, and parks the task again. There is no dispatcher thread
// between the event and the thread that serves it: the thread woken is the one that serves.
//
// So what a step takes is CPU time, never a peer's pace: a peer that sends part of a frame,
// or stops reading an answer, costs a parked task (its buffers, a descriptor), never a
// thread. A step may still do work that takes long (a checksum over the bytes read, copying
// what the socket takes of a large answer: its share is bounded per step, server.cc), and a
// few requests wait, within short bounds, on the process's own state (a NIXL revoke).
//
// A parked task may also ask for a timer step (Run with ready false) at a given time: that is
// how a task's deadlines are kept while it is parked (a frame's 30 s from its first byte, the
// handshake's 10 s, the 120 s a stalled reader or writer of an answer is given: past one,
// the task closes its connection), and how a connection that holds same-host grants checks
// them for expiry (every 100 ms). One timerfd in the set ticks every 100 ms while any such
// timer is due, so a timer step comes up to 100 ms late.
//
// Tasks belong to a group (IoGroup: a server's connections, a link's reverse channel) that is
// stopped as one: parked tasks are removed at once, running ones are woken (Task::Cancel shuts
// their socket down) and waited for; Stop returns when none of the group's tasks is running.
//
// Thread-safe. IoPool::Shared() is the process's pool: made at first use, its threads joined
// when its last holder (a server, a link with a reverse channel) lets go. Making it may fail
// (std::system_error: not one thread could be started, e.g. RLIMIT_NPROC or a pids cgroup);
// IoGroup::Add then throws it and the next Add tries again.
#ifndef DATADIST_CPP_IOPOOL_H_
#define DATADIST_CPP_IOPOOL_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "net.h"

namespace datadist {

class IoPool {
 public:
  /// One connection served a request at a time. Run is never called twice at once for a task.
  class Task {
   public:
    virtual ~Task() = default;
    /// The socket watched while the task is parked; open while parked.
    virtual int fd() const = 0;
    /// On a pool thread: a step, for the event asked for (`ready`: the socket is ready, or
    /// closed, or broke), or a timer step (!ready). Returns true to be parked again, with
    /// `wake` set to when a timer step is due (Deadline::max(): none) and Interest() saying
    /// what to watch for; false when done (the task closed, or handed on, its connection).
    /// Should not wait on its peer (see above). Exceptions count as done.
    virtual bool Run(bool ready, Deadline &wake) = 0;
    /// What the parked task waits for: EPOLLIN (the default) or EPOLLOUT. Read at each park,
    /// on the thread that parks it (after Run, or in Park).
    virtual uint32_t Interest() const { return 0x001; /* EPOLLIN */ }
    /// The task's group is being stopped while Run is in progress or about to be: wake Run up
    /// (shut the socket down). Called from the stopping thread with the pool's lock held: must
    /// neither block nor call the pool.
    virtual void Cancel() = 0;
  };
  /// The state of one group of tasks (see IoGroup), guarded by the pool's lock.
  struct Group {
    bool stopped = false;
    size_t running = 0;      // tasks of the group in Run (or claimed for it)
    std::set<uint64_t> ids;  // its tasks in the pool
  };

  /// The number of threads a pool gets by default: DATADIST_IO_THREADS (1..64) if set, else the
  /// hardware's concurrency, at least 2 and at most 8.
  static size_t DefaultThreads();
  /// The process's pool (DefaultThreads() threads), made by the first caller; it lives while
  /// anyone holds it. A forked child gets a pool of its own (the parent's threads are not
  /// there).
  static std::shared_ptr<IoPool> Shared();
  /// For tests: the next `n` threads a pool would start fail to, as when the process is at its
  /// thread limit (std::system_error, EAGAIN).
  static void FailThreadStartsForTest(size_t n);

  /// Starts `threads` threads (fewer if not all can be: served more slowly). std::system_error
  /// if not one can be started; LLM_FAILED if the epoll set cannot be made.
  explicit IoPool(size_t threads);
  /// Joins the threads (every group must have been stopped). Not from a pool thread (if it
  /// is, that thread is detached rather than joined, and ends without touching the pool).
  ~IoPool();
  IoPool(const IoPool &) = delete;
  IoPool &operator=(const IoPool &) = delete;

  size_t threads() const { return threads_.size(); }
  /// Parks `task` in `group`: its socket watched for task->Interest(), a timer step at `wake`. False (nothing
  /// taken: the caller closes the connection) once the group is stopped, or if the socket
  /// cannot be watched. Never blocks.
  bool Park(Group &group, std::shared_ptr<Task> task, Deadline wake = Deadline::max());
  /// Stops `group`: no more tasks are taken; parked ones are removed and destroyed on this
  /// thread, running ones cancelled and waited for (each within its request's deadlines, and
  /// at once when it blocks only on its socket). Not from one of the group's own tasks.
  void Stop(Group &group);
  /// How many tasks are in the pool, parked or running (for tests).
  size_t tasks();

 private:
  enum class State { kParked, kRunning };
  struct Entry {
    std::shared_ptr<Task> task;
    Group *group = nullptr;
    State state = State::kParked;
    Deadline wake = Deadline::max();
  };
  void Loop();
  /// Claims a parked task for a step (lock held): unwatched, counted running.
  /// `fired`: for its event (its socket left in the set, disarmed); else for a timer step.
  std::shared_ptr<Task> ClaimLocked(uint64_t id, Entry &e, bool fired);
  void Step(uint64_t id, std::shared_ptr<Task> task, bool readable);
  void Tick();  // the timer: tasks whose wake passed get their step
  void ArmTimerLocked(bool on);
  /// Arms the task's socket for one event of its Interest() under `id`: MOD where it is in
  /// the set, disarmed (`in_set`: its event fired), else ADD (MOD where a handed-on socket is
  /// still there). False if the socket cannot be watched.
  bool Watch(uint64_t id, const Task &task, bool in_set);

  int ep_ = -1;
  int wake_fd_ = -1;   // eventfd: readable once the pool ends (every thread leaves)
  int timer_fd_ = -1;  // timerfd: ticks while a parked task has a timer
  std::mutex mu_;
  std::condition_variable stopped_;  // a stopped group's running count fell
  uint64_t next_id_ = 8;             // ids below are the pool's own descriptors
  std::map<uint64_t, Entry> tasks_;
  std::set<uint64_t> timed_;  // parked tasks with a timer
  bool timer_on_ = false;
  std::vector<std::thread> threads_;
};

/// A group of tasks in a pool (a server's connections, a link's reverse channel), stopped as
/// one, when its owner stops or at the latest when the group is destroyed. The pool is the
/// process's shared one unless one is given; it is taken at the first Add and let go by Stop.
class IoGroup {
 public:
  explicit IoGroup(std::shared_ptr<IoPool> pool = nullptr) : pool_(std::move(pool)) {}
  ~IoGroup() { Stop(); }
  IoGroup(const IoGroup &) = delete;
  IoGroup &operator=(const IoGroup &) = delete;
  /// Parks `task` (see IoPool::Park). False once stopped: the caller closes the connection.
  /// Throws what IoPool::Shared() throws when the group has no pool yet and none can be made
  /// (std::system_error): nothing taken, the next Add tries again.
  bool Add(std::shared_ptr<IoPool::Task> task, Deadline wake = Deadline::max());
  /// See IoPool::Stop. Final: later Adds are refused. Blocks (bounded).
  void Stop();

 private:
  std::mutex mu_;  // guards pool_ and stopped_ (the pool's lock guards group_)
  std::shared_ptr<IoPool> pool_;
  bool stopped_ = false;
  IoPool::Group group_;
};

}  // namespace datadist

#endif  // DATADIST_CPP_IOPOOL_H_

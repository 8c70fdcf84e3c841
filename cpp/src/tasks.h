// Transfers a caller issues and then polls or waits on (datadist's asynchronous pulls and
// pushes, NIXL's post-then-check pattern): a fixed set of worker threads runs them, whatever
// their number, and a Task says when one has ended and how.
//
// Who calls: the Python extension (cpp/python/) for pull_*_async / push_*_async, through the
// session (session.h), which also ends tasks itself for the issued pulls it runs back to back on
// one link (Task::Pending, Task::Finish). Submit never blocks; Task::Done never blocks;
// Task::Wait blocks up to its deadline. Thread-safe.
#ifndef DATADIST_CPP_TASKS_H_
#define DATADIST_CPP_TASKS_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "errors.h"
#include "net.h"

namespace datadist {

class Task {
 public:
  /// A task that ended already (code 0: success), for work done in the issuing thread.
  static std::shared_ptr<Task> Ended(uint32_t code, std::string message, ErrorKind kind = ErrorKind::kGeneral);
  /// A task not ended yet, for work that its runner ends itself (Finish) rather than an
  /// Executor: the session's issued pulls of one link, run back to back by one worker.
  static std::shared_ptr<Task> Pending() { return std::make_shared<Task>(); }
  /// Ended (successfully or not)? Never blocks: one atomic load.
  bool Done() const { return done_.load(std::memory_order_acquire); }
  /// Blocks until the task ends or `deadline` passes; true when it ended.
  bool Wait(Deadline deadline);
  /// Once Done: 0 (LLM_SUCCESS) or the status code of the error that ended it, and its message.
  uint32_t code() const { return code_; }
  const std::string &message() const { return message_; }
  /// Once Done: the kind of the error that ended it (errors.h).
  ErrorKind kind() const { return kind_; }
  /// Ends the task (code 0: success) and wakes its waiters; the first call wins, later ones
  /// do nothing. Who calls: the Executor for what it runs, the runner of a Pending task.
  /// Never blocks (the task's mutex only).
  void Finish(uint32_t code, std::string message, ErrorKind kind = ErrorKind::kGeneral);

 private:
  std::mutex mu_;
  std::condition_variable ended_;
  std::atomic<bool> done_{false};
  uint32_t code_ = 0;
  std::string message_;
  ErrorKind kind_ = ErrorKind::kGeneral;
};

class Executor {
 public:
  /// `threads` workers, started at the first Submit.
  explicit Executor(size_t threads) : size_(threads == 0 ? 1 : threads) {}
  ~Executor() { Stop(); }
  Executor(const Executor &) = delete;
  Executor &operator=(const Executor &) = delete;
  /// Queues `fn`; the task ends when it returns (code 0) or throws (datadist::Error: its code;
  /// anything else: LLM_FAILED). After Stop, the task ends at once with LLM_FAILED.
  std::shared_ptr<Task> Submit(std::function<void()> fn);
  /// Takes no more work: tasks still queued (and any submitted later) end with LLM_FAILED
  /// ("closed"); running ones go on. Never blocks. Idempotent.
  void Close();
  /// Close, then waits for the running tasks (each under its own deadline, or failed sooner
  /// by whatever closed their links) and joins the workers. Idempotent.
  void Stop();
  size_t threads() const { return size_; }
  /// Closed (Close or Stop called): nothing submitted now will run. Never blocks.
  bool closed();
  /// Queued or running right now.
  size_t pending();

 private:
  void Run();
  const size_t size_;
  std::mutex mu_;
  std::condition_variable work_;
  bool stopped_ = false;
  size_t running_ = 0;
  std::deque<std::pair<std::shared_ptr<Task>, std::function<void()>>> queue_;
  std::vector<std::thread> workers_;
};

}  // namespace datadist

#endif  // DATADIST_CPP_TASKS_H_

#include "tasks.h"

#include <exception>

#include "errors.h"
#include "threads.h"

namespace datadist {

std::shared_ptr<Task> Task::Ended(uint32_t code, std::string message, ErrorKind kind) {
  auto task = std::make_shared<Task>();
  task->Finish(code, std::move(message), kind);
  return task;
}

bool Task::Wait(Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  return ended_.wait_until(lock, deadline, [&] { return done_.load(std::memory_order_acquire); });
}

void Task::Finish(uint32_t code, std::string message, ErrorKind kind) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_.load(std::memory_order_relaxed)) return;  // ended already: the first outcome stays
    code_ = code;
    message_ = std::move(message);
    kind_ = kind;
    done_.store(true, std::memory_order_release);
  }
  ended_.notify_all();
}

std::shared_ptr<Task> Executor::Submit(std::function<void()> fn) {
  auto task = std::make_shared<Task>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopped_) {
      if (workers_.empty())
        for (size_t i = 0; i < size_; ++i)
          workers_.emplace_back([this] {
            EnterCoreThread("datadist-task");
            Run();
          });
      queue_.emplace_back(task, std::move(fn));
      work_.notify_one();
      return task;
    }
  }
  task->Finish(llm_datadist::LLM_FAILED, "the engine is closed: the transfer was not started", ErrorKind::kGeneral);
  return task;
}

bool Executor::closed() {
  std::lock_guard<std::mutex> lock(mu_);
  return stopped_;
}

size_t Executor::pending() {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size() + running_;
}

void Executor::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_.wait(lock, [&] { return stopped_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopped, nothing left
    auto job = std::move(queue_.front());
    queue_.pop_front();
    ++running_;
    lock.unlock();
    uint32_t code = 0;
    std::string message;
    ErrorKind kind = ErrorKind::kGeneral;
    try {
      job.second();
    } catch (const Error &e) {
      code = e.code();
      message = e.what();
      kind = e.kind();
    } catch (const std::exception &e) {
      code = llm_datadist::LLM_FAILED;
      message = e.what();
    }
    job.second = nullptr;  // what the closure holds goes before the task says it ended
    job.first->Finish(code, std::move(message), kind);
    lock.lock();
    --running_;
  }
}

void Executor::Close() {
  std::deque<std::pair<std::shared_ptr<Task>, std::function<void()>>> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    dropped.swap(queue_);
  }
  work_.notify_all();
  for (auto &job : dropped) {
    job.second = nullptr;
    job.first->Finish(ge::LLM_ENGINE_FINALIZED, "the engine was finalized before the transfer started",
                      ErrorKind::kGeneral);
  }
}

void Executor::Stop() {
  Close();
  std::vector<std::thread> workers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    workers.swap(workers_);
  }
  for (auto &t : workers) t.join();
}

}  // namespace datadist

#include "iopool.h"

#include <errno.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <system_error>

#include "errors.h"
#include "threads.h"

namespace datadist {
namespace {

constexpr uint64_t kWakeId = 1;              // the eventfd that ends the threads
constexpr uint64_t kTimerId = 2;             // the timerfd
constexpr long kTickNs = 100 * 1000 * 1000;  // timer steps are due to within this (100 ms)

// The pool the current thread serves, and whether that pool was destroyed under it (its
// last holder let go from one of its own tasks): the thread then leaves without touching it.
thread_local IoPool *current_pool = nullptr;
thread_local bool orphaned = false;

std::atomic<size_t> failing_starts{0};  // FailThreadStartsForTest

}  // namespace

size_t IoPool::DefaultThreads() {
  if (const char *v = std::getenv("DATADIST_IO_THREADS")) {
    char *end = nullptr;
    long n = std::strtol(v, &end, 10);
    if (end != v && *end == '\0' && n >= 1 && n <= 64) return static_cast<size_t>(n);
  }
  const size_t hw = std::thread::hardware_concurrency();
  return std::min<size_t>(8, std::max<size_t>(2, hw));
}

std::shared_ptr<IoPool> IoPool::Shared() {
  static std::mutex mu;
  static std::weak_ptr<IoPool> *shared = new std::weak_ptr<IoPool>();  // never destroyed: no exit-order trouble
  static pid_t made_in = 0;
  std::lock_guard<std::mutex> lock(mu);
  // A forked child inherits the parent's pool object but none of its threads: it makes its own.
  if (made_in != getpid()) *shared = std::weak_ptr<IoPool>();
  std::shared_ptr<IoPool> pool = shared->lock();
  if (!pool) {
    pool = std::make_shared<IoPool>(DefaultThreads());
    *shared = pool;
    made_in = getpid();
  }
  return pool;
}

void IoPool::FailThreadStartsForTest(size_t n) { failing_starts = n; }

IoPool::IoPool(size_t threads) {
  ep_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  timer_fd_ = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
  if (ep_ < 0 || wake_fd_ < 0 || timer_fd_ < 0) {
    const std::string why = std::strerror(errno);
    for (int fd : {ep_, wake_fd_, timer_fd_})
      if (fd >= 0) close(fd);
    Fail(llm_datadist::LLM_FAILED, "cannot make the I/O threads' epoll set: " + why);
  }
  // Level-triggered, never consumed: once written, every thread sees it and leaves.
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kWakeId;
  (void)epoll_ctl(ep_, EPOLL_CTL_ADD, wake_fd_, &ev);
  ev.data.u64 = kTimerId;
  (void)epoll_ctl(ep_, EPOLL_CTL_ADD, timer_fd_, &ev);
  threads = std::max<size_t>(1, threads);
  try {
    for (size_t i = 0; i < threads; ++i) {
      for (size_t n = failing_starts.load(); n > 0;)
        if (failing_starts.compare_exchange_weak(n, n - 1))
          throw std::system_error(EAGAIN, std::generic_category(), "thread start refused (test)");
      threads_.emplace_back([this] { Loop(); });
    }
  } catch (const std::system_error &) {
    if (threads_.empty()) {  // not one thread: nothing could be served
      close(ep_);
      close(wake_fd_);
      close(timer_fd_);
      throw;
    }  // fewer threads than asked: served, more slowly
  }
}

IoPool::~IoPool() {
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  const std::thread::id self = std::this_thread::get_id();
  for (std::thread &t : threads_) {
    if (t.get_id() == self) {  // our last holder let go from one of our tasks
      orphaned = true;
      t.detach();
    } else if (t.joinable()) {
      t.join();
    }
  }
  // Every group was stopped before its owner let go of the pool: nothing is left, but should a
  // task be, it goes (and closes its connection) here.
  tasks_.clear();
  close(ep_);
  close(wake_fd_);
  close(timer_fd_);
}

size_t IoPool::tasks() {
  std::lock_guard<std::mutex> lock(mu_);
  return tasks_.size();
}

bool IoPool::Watch(uint64_t id, const Task &task, bool in_set) {
  const int fd = task.fd();
  if (fd < 0) return false;
  epoll_event ev{};
  // EPOLLRDHUP with reads only: a peer that shut its sending side but still reads what we
  // send would wake a task waiting for room at once, again and again.
  const uint32_t interest = task.Interest() & (EPOLLIN | EPOLLOUT);
  ev.events = (interest ? interest : EPOLLIN) | EPOLLONESHOT;
  if (ev.events & EPOLLIN) ev.events |= EPOLLRDHUP;
  ev.data.u64 = id;
  // A socket whose one-shot event fired is still in the set, disarmed: re-armed by one MOD
  // (level-triggered: what is there already is reported at once). One handed on by a task
  // that ended (a reverse channel) and parked anew is there too, under its old id: ADD finds
  // it (EEXIST) and MOD arms it under the new one.
  if (in_set && epoll_ctl(ep_, EPOLL_CTL_MOD, fd, &ev) == 0) return true;
  if (epoll_ctl(ep_, EPOLL_CTL_ADD, fd, &ev) == 0) return true;
  return errno == EEXIST && epoll_ctl(ep_, EPOLL_CTL_MOD, fd, &ev) == 0;
}

void IoPool::ArmTimerLocked(bool on) {
  if (on == timer_on_) return;
  itimerspec spec{};
  if (on) spec.it_value.tv_nsec = spec.it_interval.tv_nsec = kTickNs;
  (void)timerfd_settime(timer_fd_, 0, &spec, nullptr);
  timer_on_ = on;
}

bool IoPool::Park(Group &group, std::shared_ptr<Task> task, Deadline wake) {
  std::lock_guard<std::mutex> lock(mu_);
  if (group.stopped) return false;
  const uint64_t id = next_id_++;
  if (!Watch(id, *task, false)) return false;
  Entry &e = tasks_[id];
  e.task = std::move(task);
  e.group = &group;
  e.wake = wake;
  group.ids.insert(id);
  if (wake != Deadline::max()) {
    timed_.insert(id);
    ArmTimerLocked(true);
  }
  return true;
}

std::shared_ptr<IoPool::Task> IoPool::ClaimLocked(uint64_t id, Entry &e, bool fired) {
  // Never watched while it runs. Claimed for its event (`fired`): the one-shot event disarmed
  // the socket, which stays in the set (re-armed by one MOD when parked again: no DEL + ADD
  // per request). A disarmed socket reports nothing, so the task may close its connection in
  // Run (closing removes it from the set) or hand it on (see Watch). Claimed for a timer
  // step: still armed, so taken out (the descriptor is open: the task is parked).
  if (!fired) (void)epoll_ctl(ep_, EPOLL_CTL_DEL, e.task->fd(), nullptr);
  e.state = State::kRunning;
  ++e.group->running;
  timed_.erase(id);
  return e.task;
}

void IoPool::Loop() {
  current_pool = this;
  EnterCoreThread("datadist-io");
  for (;;) {
    epoll_event ev{};
    const int n = epoll_wait(ep_, &ev, 1, -1);
    if (n < 0 && errno != EINTR) return;
    if (n <= 0) continue;
    const uint64_t id = ev.data.u64;  // a copy: epoll_event is packed, a reference to its field misaligned (UBSan)
    if (id == kWakeId) return;
    if (id == kTimerId) {
      uint64_t ticks = 0;
      if (read(timer_fd_, &ticks, sizeof(ticks)) == static_cast<ssize_t>(sizeof(ticks))) Tick();
      if (orphaned) return;
      continue;
    }
    std::shared_ptr<Task> task;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = tasks_.find(id);
      // Gone (its group stopped), or taken by the timer meanwhile: that step parks it again.
      if (it == tasks_.end() || it->second.state != State::kParked) continue;
      task = ClaimLocked(it->first, it->second, true);
    }
    Step(id, std::move(task), true);
    if (orphaned) return;
  }
}

void IoPool::Tick() {
  std::vector<std::pair<uint64_t, std::shared_ptr<Task>>> due;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Deadline now = Clock::now();
    for (auto it = timed_.begin(); it != timed_.end();) {
      const uint64_t id = *it++;  // ClaimLocked erases it
      auto e = tasks_.find(id);
      if (e != tasks_.end() && e->second.state == State::kParked && e->second.wake <= now)
        due.emplace_back(id, ClaimLocked(id, e->second, false));
    }
    ArmTimerLocked(!timed_.empty());
  }
  // Timer steps are short (grants checked, an expired handshake closed): run here, in turn.
  for (auto &d : due) {
    Step(d.first, std::move(d.second), false);
    if (orphaned) return;
  }
}

void IoPool::Step(uint64_t id, std::shared_ptr<Task> task, bool readable) {
  Deadline wake = Deadline::max();
  bool again = false;
  try {
    again = task->Run(readable, wake);
  } catch (...) {  // done: nothing a task throws escapes the thread
    again = false;
  }
  if (orphaned) return;  // the pool is gone (see ~IoPool)
  std::unique_lock<std::mutex> lock(mu_);
  auto it = tasks_.find(id);
  Group *group = it->second.group;
  if (again && !group->stopped && Watch(id, *task, readable)) {
    it->second.state = State::kParked;
    it->second.wake = wake;
    if (wake != Deadline::max()) {
      timed_.insert(id);
      ArmTimerLocked(true);
    }
  } else {
    // Done: destroyed (its grants released, its connection closed) before the group hears the
    // task ended, so that a stopped owner never outlives a task that refers to it.
    group->ids.erase(id);
    tasks_.erase(it);
    lock.unlock();
    task.reset();
    lock.lock();
  }
  if (--group->running == 0 && group->stopped) stopped_.notify_all();
}

void IoPool::Stop(Group &group) {
  std::vector<std::shared_ptr<Task>> parked;
  {
    std::unique_lock<std::mutex> lock(mu_);
    group.stopped = true;
    for (auto id = group.ids.begin(); id != group.ids.end();) {
      auto it = tasks_.find(*id);
      if (it->second.state == State::kParked) {
        (void)epoll_ctl(ep_, EPOLL_CTL_DEL, it->second.task->fd(), nullptr);
        parked.push_back(std::move(it->second.task));
        timed_.erase(*id);
        tasks_.erase(it);
        id = group.ids.erase(id);
      } else {
        it->second.task->Cancel();
        ++id;
      }
    }
    stopped_.wait(lock, [&] { return group.running == 0; });
  }
  parked.clear();  // closes their connections, releases their grants
}

bool IoGroup::Add(std::shared_ptr<IoPool::Task> task, Deadline wake) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_) return false;
  if (!pool_) pool_ = IoPool::Shared();
  return pool_->Park(group_, std::move(task), wake);
}

void IoGroup::Stop() {
  std::shared_ptr<IoPool> pool;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    stopped_ = true;
    pool = std::move(pool_);
  }
  if (pool) pool->Stop(group_);
  // `pool` goes here: the last holder's going joins its threads.
}

}  // namespace datadist

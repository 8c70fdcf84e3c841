#include "threads.h"

#include <pthread.h>
#include <sched.h>

#include <mutex>
#include <utility>

namespace datadist {
namespace {

std::mutex g_mu;
std::vector<int> g_cpus;  // under g_mu

}  // namespace

void SetThreadCpus(std::vector<int> cpus) {
  std::vector<int> kept;
  for (int c : cpus)
    if (c >= 0 && c < CPU_SETSIZE) kept.push_back(c);
  std::lock_guard<std::mutex> lock(g_mu);
  g_cpus = std::move(kept);
}

std::vector<int> ThreadCpus() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_cpus;
}

void EnterCoreThread(const char *name) {
  pthread_setname_np(pthread_self(), name);  // ERANGE past 15 characters: names are short
  const std::vector<int> cpus = ThreadCpus();
  if (cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  (void)pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // EINVAL: none allowed, stays
}

}  // namespace datadist

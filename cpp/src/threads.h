// The core's own threads: their names and the CPUs they run on.
//
// Linux starts a thread on the CPUs its creator may use. An engine made, or a transfer
// issued, from a compute thread that OpenMP pinned to one core (vLLM's CPU workers bind
// theirs so) would move its bytes on that one core, beside the model's forward pass, while
// the rest of the process's CPUs idle. SetThreadCpus names the CPUs for the core's threads
// instead; every thread the core starts (the I/O pool's, the workers of issued transfers and
// layer runs, the threads of a transfer to several peers at once, the listener's accept and
// adopter threads, NIXL's pump and revokers) calls EnterCoreThread first, which names it
// ("datadist-io", "datadist-task", ...: visible in top -H, perf, /proc) and moves it there.
//
// Who calls: SetThreadCpus, the Python package (datadist.set_thread_cpus) before it makes an
// engine, usually once; it applies to threads started after it (those running keep their
// CPUs). EnterCoreThread: each core thread, once, first thing. Neither blocks; thread-safe.
#ifndef DATADIST_CPP_THREADS_H_
#define DATADIST_CPP_THREADS_H_

#include <vector>

namespace datadist {

/// The CPUs core threads started from now on run on; empty (the default): the CPUs of the
/// thread that starts them. CPUs at or past CPU_SETSIZE are ignored.
void SetThreadCpus(std::vector<int> cpus);
/// What SetThreadCpus set last (empty: inherited).
std::vector<int> ThreadCpus();
/// Names the calling thread (at most 15 characters are kept) and, when SetThreadCpus named
/// CPUs, moves it onto them (a kernel that refuses, e.g. CPUs outside the cgroup's set,
/// leaves it where it was). Never throws.
void EnterCoreThread(const char *name);

}  // namespace datadist

#endif  // DATADIST_CPP_THREADS_H_

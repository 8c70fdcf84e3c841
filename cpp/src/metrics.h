// Transfer metrics of the process: per (operation, remote cluster id), how many transfers
// ended, the bytes the successful ones moved, the failed ones per status code, and a histogram
// of their durations, with the names and units the Python API reports
// (src/datadist/core/metrics.py reads them): operations "pull" and "push"
// (what this process asked of a peer) and "serve_read", "serve_write", "serve_lease" (what a
// peer asked of it; a refusal counts with its status code).
//
// Who records: the transfer paths (the Python binding's transfer / submit, the C++ API's pulls
// and pushes) and the server's dispatch, after each transfer or request ended, on the thread
// that ran it. Recording takes no lock: a series is found in a table that readers walk without
// one (a mutex only where a series is made, once per operation and cluster id) and its counters
// are atomics. Who reads: Snapshot (datadist.metrics(), the Prometheus collector, the C++
// API's GetMetrics) and StatsJson (the answer to a peer's STATS_REQUEST), at any time.
// Counters only grow (a Prometheus counter must never go down) until Reset (tests).
//
// Which cluster ids get a series of their own (docs/engine.md, "Metrics"): a peer's id is only
// its claim, so a stranger must not be able to grow the table. An id is *named* (Admit) when a
// link to it exists: a peer's control channel completed its handshake with us (after AUTH
// when a secret is set: the engine's Identity::on_control), or we linked to it (the engine's
// AdoptLink; our own pulls and pushes name their link's id too). At most kMaxNamedPeers ids are
// ever named; everything else (a refusal before or during the handshake, requests on the
// connection of an id not named, ids past the cap) counts in one series, cluster id
// kOtherPeers. A named id keeps its series for the life of the process (an unlinked peer's
// counters stay, as before; Reset zeroes them but names stay named). So the table holds at most
// (kMaxNamedPeers + 1) x kOps series, whatever strangers claim.
#ifndef DATADIST_CPP_METRICS_H_
#define DATADIST_CPP_METRICS_H_

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "errors.h"
#include "net.h"

namespace datadist {
namespace metrics {

enum class Op : uint8_t { kPull = 0, kPush, kServeRead, kServeWrite, kServeLease };
constexpr size_t kOps = 5;
/// "pull", "push", "serve_read", "serve_write", "serve_lease".
const char *OpName(Op op);

/// Upper bounds of the latency buckets, in nanoseconds: 10 us .. 100 s, three per decade
/// (Python's BUCKETS); a duration counts in the first bucket whose bound it does not exceed,
/// or above them all.
constexpr size_t kBuckets = 22;
extern const std::array<uint64_t, kBuckets> kBucketNs;
/// The bounds as Python writes them (repr: "1e-05", "0.0001", "1.0"), JSON's keys.
extern const std::array<const char *, kBuckets> kBucketText;

/// One series, copied out (Snapshot).
struct Series {
  Op op = Op::kPull;
  uint64_t cluster_id = 0;
  uint64_t transfers = 0;
  uint64_t bytes = 0;                                    // moved by the transfers that succeeded
  uint64_t nanos = 0;                                    // every transfer's duration, summed
  std::array<uint64_t, kBuckets + 1> counts{};           // per bucket (not cumulative); the last: above all
  std::vector<std::pair<std::string, uint64_t>> errors;  // status code name ("LLM_TIMEOUT") -> count
  double seconds() const { return static_cast<double>(nanos) / 1e9; }
  /// The upper bound (s) of the bucket holding quantile q; -1 before any transfer, +inf above
  /// the last bucket (Python's Series.quantile).
  double Quantile(double q) const;
};

/// The most cluster ids with series of their own; the rest fold into kOtherPeers.
constexpr size_t kMaxNamedPeers = 1024;
/// The cluster id of the folded series ("other peers": ids not named, or past the cap). A peer
/// that claims this id counts there too.
constexpr uint64_t kOtherPeers = ~uint64_t{0};
/// Gives `cluster_id` a series of its own from now on, within the cap: true when it has one
/// (now or before), false when it folds into kOtherPeers. Called when a link to that id is
/// made (see above); never blocks beyond a short mutex the first time an id is named.
bool Admit(uint64_t cluster_id);
/// Has `cluster_id` a series of its own? Lock-free.
bool IsNamed(uint64_t cluster_id);
/// How many ids are named, and how many series (cells) the table holds (tests).
size_t NamedCount();
size_t CellCount();

/// Counts one transfer or served request that ended: `code` 0 when it succeeded (then `nbytes`
/// count as moved), else its status code. Under `cluster_id`'s series when it is named (pull
/// and push name it: this process's own link), else under kOtherPeers. Never blocks.
void Record(Op op, uint64_t cluster_id, uint64_t nbytes, Clock::duration took, Status code);
/// Record, with the time since `since`.
inline void RecordSince(Op op, uint64_t cluster_id, uint64_t nbytes, Clock::time_point since, Status code) {
  Record(op, cluster_id, nbytes, Clock::now() - since, code);
}
/// Every series with a transfer counted, in no particular order.
std::vector<Series> Snapshot();
/// Zeroes every counter (tests; a scraper sees a counter reset).
void Reset();
/// llm_datadist's name of a status code ("LLM_KV_CACHE_NOT_EXIST"); codes it does not know
/// are "LLM_FAILED", as Python's engine counts anything but its own errors.
const char *StatusName(Status code);

/// What a peer's STATS_REQUEST is answered with (as JSON):
/// {"cluster_id": us, "role": role, "total": own, "links": {"<peer>": own}} where own holds
/// the peer's own series by operation, nothing when `told` is false (the asking connection
/// is not the one that peer's live link belongs to, or `peer` is not named: the folded series
/// is nobody's own), and links is {} when own is empty. Looks up the peer's own cells (one
/// probe per operation): its cost does not grow with the table.
std::string StatsJson(uint64_t self_cluster_id, int32_t role, uint64_t peer, bool told);
/// One series as Python's Series.snapshot() writes it in JSON (transfers, bytes, errors,
/// seconds, latency_buckets (cumulative), p50_s, p99_s).
std::string SeriesJson(const Series &s);

/// A served request being counted: Done(nbytes) counts it as having
/// moved its bytes; gone before Done (the connection broke, a deadline passed) it counts as
/// LLM_FAILED, whatever the error was.
class Serving {
 public:
  Serving(Op op, uint64_t cluster_id, Clock::time_point since) : op_(op), cluster_(cluster_id), since_(since) {}
  ~Serving() {
    if (!done_) RecordSince(op_, cluster_, 0, since_, llm_datadist::LLM_FAILED);
  }
  Serving(const Serving &) = delete;
  Serving &operator=(const Serving &) = delete;
  void Done(uint64_t nbytes) {
    done_ = true;
    RecordSince(op_, cluster_, nbytes, since_, llm_datadist::LLM_SUCCESS);
  }

 private:
  Op op_;
  uint64_t cluster_;
  Clock::time_point since_;
  bool done_ = false;
};

/// Runs a pull or push and counts its outcome (`nbytes` when it succeeded, else its status
/// code) as `op` with `cluster_id`, timed from `since`; rethrows what it threw.
template <typename F>
void Timed(Op op, uint64_t cluster_id, uint64_t nbytes, Clock::time_point since, F &&run) {
  try {
    run();
  } catch (const Error &e) {
    RecordSince(op, cluster_id, 0, since, e.code());
    throw;
  } catch (...) {
    RecordSince(op, cluster_id, 0, since, llm_datadist::LLM_FAILED);
    throw;
  }
  RecordSince(op, cluster_id, nbytes, since, llm_datadist::LLM_SUCCESS);
}

}  // namespace metrics
}  // namespace datadist

#endif  // DATADIST_CPP_METRICS_H_

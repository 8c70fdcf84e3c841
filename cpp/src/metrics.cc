#include "metrics.h"

#include <atomic>
#include <charconv>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>

namespace datadist {
namespace metrics {

const std::array<uint64_t, kBuckets> kBucketNs = {
    10000ULL,       25000ULL,       50000ULL,       100000ULL,      250000ULL,     500000ULL,
    1000000ULL,     2500000ULL,     5000000ULL,     10000000ULL,    25000000ULL,   50000000ULL,
    100000000ULL,   250000000ULL,   500000000ULL,   1000000000ULL,  2500000000ULL, 5000000000ULL,
    10000000000ULL, 25000000000ULL, 50000000000ULL, 100000000000ULL};
const std::array<const char *, kBuckets> kBucketText = {
    "1e-05", "2.5e-05", "5e-05", "0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025",
    "0.05",  "0.1",     "0.25",  "0.5",    "1.0",     "2.5",    "5.0",   "10.0",   "25.0",  "50.0", "100.0"};

namespace {

// The status codes Python's engine names (core/errors.py Code), in a fixed order: a series
// keeps one counter per entry; the last one, LLM_FAILED, also takes every code not listed.
struct Named {
  Status code;
  const char *name;
};
constexpr Named kCodes[] = {
    {0x5010B001U, "LLM_WAIT_PROCESS_TIMEOUT"},
    {0x5010B002U, "LLM_KV_CACHE_NOT_EXIST"},
    {0x5010B003U, "LLM_REPEAT_REQUEST"},
    {0x5010B004U, "LLM_REQUEST_ALREADY_COMPLETED"},
    {0x5010B005U, "LLM_PARAM_INVALID"},
    {0x5010B006U, "LLM_ENGINE_FINALIZED"},
    {0x5010B007U, "LLM_NOT_YET_LINK"},
    {0x5010B008U, "LLM_ALREADY_LINK"},
    {0x5010B009U, "LLM_LINK_FAILED"},
    {0x5010B00AU, "LLM_UNLINK_FAILED"},
    {0x5010B00BU, "LLM_NOTIFY_PROMPT_UNLINK_FAILED"},
    {0x5010B00CU, "LLM_CLUSTER_NUM_EXCEED_LIMIT"},
    {0x5010B00DU, "LLM_PROCESSING_LINK"},
    {0x5010B00EU, "LLM_DEVICE_OUT_OF_MEMORY"},
    {0x5010B00FU, "LLM_PREFIX_ALREADY_EXIST"},
    {0x5010B010U, "LLM_PREFIX_NOT_EXIST"},
    {0x5010B011U, "LLM_SEQ_LENOVERLIMIT"},  // sic: llm_datadist's spelling
    {0x5010B012U, "LLM_NO_FREE_BLOCK"},
    {0x5010B013U, "LLM_BLOCKS_OUT_OF_MEMORY"},
    {0x5010B018U, "LLM_EXIST_LINK"},
    {0x5010B019U, "LLM_FEATURE_NOT_ENABLED"},
    {0x5010B01AU, "LLM_TIMEOUT"},
    {0x5010B01BU, "LLM_LINK_BUSY"},
    {0x5010B01CU, "LLM_OUT_OF_MEMORY"},
    {507053U, "LLM_DEVICE_MEM_ERROR"},
    {507057U, "LLM_SUSPECT_REMOTE_ERROR"},
    {llm_datadist::LLM_FAILED, "LLM_FAILED"},
};
constexpr size_t kNamed = sizeof(kCodes) / sizeof(kCodes[0]);

size_t CodeSlot(Status code) {
  for (size_t i = 0; i + 1 < kNamed; ++i)
    if (kCodes[i].code == code) return i;
  return kNamed - 1;
}

/// One series' counters: bumped with relaxed atomic adds, read the same way.
struct Cell {
  Cell(Op o, uint64_t c) : op(o), cluster_id(c) {}
  const Op op;
  const uint64_t cluster_id;
  std::atomic<uint64_t> transfers{0}, bytes{0}, nanos{0};
  std::array<std::atomic<uint64_t>, kBuckets + 1> counts{};
  std::array<std::atomic<uint64_t>, kNamed> errors{};
};

/// An open-addressing table of cells that is only ever added to: a reader probes from the
/// key's hash until it finds the key or an empty slot (then the key is in no later slot of
/// this segment), and goes on to the next segment. Writers (a new key) hold the mutex and fill
/// the last segment to half, then chain one twice its size. Nothing is ever removed: a
/// reader never meets a freed cell, and the table lives as long as the process.
class Table {
 public:
  Table() : head_(new Segment(kFirst)) {}
  Cell *Find(Op op, uint64_t cluster) {
    Cell *c = Lookup(op, cluster);
    return c != nullptr ? c : Make(op, cluster);
  }
  /// The cell of (op, cluster), or null: nothing is made.
  Cell *Lookup(Op op, uint64_t cluster) {
    for (Segment *s = head_; s != nullptr; s = s->next.load(std::memory_order_acquire)) {
      Cell *c = s->Probe(op, cluster);
      if (c != nullptr) return c;
    }
    return nullptr;
  }
  size_t Size() {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = 0;
    for (Segment *s = head_; s != nullptr; s = s->next.load(std::memory_order_acquire)) n += s->used;
    return n;
  }
  template <typename F>
  void ForEach(F &&f) {
    for (Segment *s = head_; s != nullptr; s = s->next.load(std::memory_order_acquire))
      for (size_t i = 0; i < s->cap; ++i) {
        Cell *c = s->slots[i].load(std::memory_order_acquire);
        if (c != nullptr) f(*c);
      }
  }

 private:
  static constexpr size_t kFirst = 256;
  struct Segment {
    explicit Segment(size_t n) : cap(n), slots(new std::atomic<Cell *>[n]) {
      for (size_t i = 0; i < n; ++i) slots[i].store(nullptr, std::memory_order_relaxed);
    }
    /// The cell of (op, cluster) in this segment, or null. Probes stop at the first empty slot.
    Cell *Probe(Op op, uint64_t cluster) {
      for (size_t i = Hash(op, cluster) % cap, n = 0; n < cap; ++n, i = (i + 1) % cap) {
        Cell *c = slots[i].load(std::memory_order_acquire);
        if (c == nullptr) return nullptr;
        if (c->op == op && c->cluster_id == cluster) return c;
      }
      return nullptr;
    }
    const size_t cap;
    std::unique_ptr<std::atomic<Cell *>[]> slots;
    size_t used = 0;  // writers only (Table::mu_)
    std::atomic<Segment *> next{nullptr};
  };
  static size_t Hash(Op op, uint64_t cluster) {
    uint64_t h = (cluster ^ (static_cast<uint64_t>(op) << 56)) * 0x9E3779B97F4A7C15ULL;
    return static_cast<size_t>(h ^ (h >> 29));
  }
  Cell *Make(Op op, uint64_t cluster) {
    std::lock_guard<std::mutex> lock(mu_);
    Segment *last = head_;
    for (Segment *s = head_; s != nullptr; s = s->next.load(std::memory_order_acquire)) {
      Cell *c = s->Probe(op, cluster);  // made by another writer meanwhile
      if (c != nullptr) return c;
      last = s;
    }
    if (2 * (last->used + 1) > last->cap) {
      auto *grown = new Segment(last->cap * 2);
      last->next.store(grown, std::memory_order_release);
      last = grown;
    }
    auto *cell = new Cell(op, cluster);
    for (size_t i = Hash(op, cluster) % last->cap;; i = (i + 1) % last->cap)
      if (last->slots[i].load(std::memory_order_relaxed) == nullptr) {
        last->slots[i].store(cell, std::memory_order_release);
        break;
      }
    ++last->used;
    return cell;
  }
  std::mutex mu_;  // new keys only
  Segment *const head_;
};

Table &Process() {
  static Table *table = new Table();  // never destroyed: threads may record until exit
  return *table;
}

/// The named cluster ids: an open-addressing set that is only added to, at most half full
/// (kMaxNamedPeers ids in twice as many slots); readers probe without a lock, a new id is
/// added under the mutex. kOtherPeers marks an empty slot (and is never named).
class Names {
 public:
  Names() {
    for (auto &s : slots_) s.store(kOtherPeers, std::memory_order_relaxed);
  }
  bool Has(uint64_t id) const {
    if (id == kOtherPeers) return false;
    for (size_t i = Slot(id), n = 0; n < kSlots; ++n, i = (i + 1) % kSlots) {
      const uint64_t v = slots_[i].load(std::memory_order_acquire);
      if (v == id) return true;
      if (v == kOtherPeers) return false;
    }
    return false;
  }
  bool Add(uint64_t id) {
    if (Has(id)) return true;
    if (id == kOtherPeers) return false;
    std::lock_guard<std::mutex> lock(mu_);
    if (Has(id)) return true;
    if (count_ >= kMaxNamedPeers) return false;
    size_t i = Slot(id);
    while (slots_[i].load(std::memory_order_relaxed) != kOtherPeers) i = (i + 1) % kSlots;
    slots_[i].store(id, std::memory_order_release);
    ++count_;
    return true;
  }
  size_t Count() {
    std::lock_guard<std::mutex> lock(mu_);
    return count_;
  }

 private:
  static constexpr size_t kSlots = 2 * kMaxNamedPeers;
  static size_t Slot(uint64_t id) {
    const uint64_t h = id * 0x9E3779B97F4A7C15ULL;
    return static_cast<size_t>((h ^ (h >> 31)) % kSlots);
  }
  std::array<std::atomic<uint64_t>, kSlots> slots_;
  std::mutex mu_;
  size_t count_ = 0;  // under mu_
};

Names &ProcessNames() {
  static Names *names = new Names();  // never destroyed, as the table
  return *names;
}

Series Copy(const Cell &c) {
  Series s;
  s.op = c.op;
  s.cluster_id = c.cluster_id;
  s.transfers = c.transfers.load(std::memory_order_relaxed);
  s.bytes = c.bytes.load(std::memory_order_relaxed);
  s.nanos = c.nanos.load(std::memory_order_relaxed);
  for (size_t i = 0; i < s.counts.size(); ++i) s.counts[i] = c.counts[i].load(std::memory_order_relaxed);
  for (size_t i = 0; i < kNamed; ++i) {
    const uint64_t n = c.errors[i].load(std::memory_order_relaxed);
    if (n) s.errors.emplace_back(kCodes[i].name, n);
  }
  return s;
}

/// A double as JSON, read back to the same value (Python writes repr; the text may differ,
/// the number does not); a whole number keeps a ".0" so that it reads back as a float.
std::string Number(double v) {
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";  // as Python's json.dumps
  char buf[64];
  auto done = std::to_chars(buf, buf + sizeof(buf), v);
  std::string out(buf, done.ptr);
  if (out.find_first_of(".en") == std::string::npos) out += ".0";
  return out;
}

std::string Quoted(const std::string &s) { return "\"" + s + "\""; }  // names and digits only

}  // namespace

const char *OpName(Op op) {
  static const char *const names[kOps] = {"pull", "push", "serve_read", "serve_write", "serve_lease"};
  return names[static_cast<size_t>(op)];
}

const char *StatusName(Status code) { return kCodes[CodeSlot(code)].name; }

double Series::Quantile(double q) const {
  if (!transfers) return -1.0;
  const double rank = q * static_cast<double>(transfers);
  uint64_t seen = 0;
  for (size_t i = 0; i < kBuckets; ++i) {
    seen += counts[i];
    if (static_cast<double>(seen) >= rank) return static_cast<double>(kBucketNs[i]) / 1e9;
  }
  return std::numeric_limits<double>::infinity();
}

bool Admit(uint64_t cluster_id) { return ProcessNames().Add(cluster_id); }
bool IsNamed(uint64_t cluster_id) { return ProcessNames().Has(cluster_id); }
size_t NamedCount() { return ProcessNames().Count(); }
size_t CellCount() { return Process().Size(); }

void Record(Op op, uint64_t cluster_id, uint64_t nbytes, Clock::duration took, Status code) {
  // Our own pulls and pushes name their link's id (the caller chose it); a peer's requests
  // count under its id only if its link named it.
  const bool own = op == Op::kPull || op == Op::kPush;
  const uint64_t series = (own ? Admit(cluster_id) : IsNamed(cluster_id)) ? cluster_id : kOtherPeers;
  Cell &c = *Process().Find(op, series);
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(took).count();
  const uint64_t nanos = ns > 0 ? static_cast<uint64_t>(ns) : 0;
  size_t bucket = 0;
  while (bucket < kBuckets && nanos > kBucketNs[bucket]) ++bucket;  // the first bound not below it
  c.counts[bucket].fetch_add(1, std::memory_order_relaxed);
  c.nanos.fetch_add(nanos, std::memory_order_relaxed);
  if (code == llm_datadist::LLM_SUCCESS)
    c.bytes.fetch_add(nbytes, std::memory_order_relaxed);
  else
    c.errors[CodeSlot(code)].fetch_add(1, std::memory_order_relaxed);
  c.transfers.fetch_add(1, std::memory_order_release);
}

std::vector<Series> Snapshot() {
  std::vector<Series> out;
  Process().ForEach([&](const Cell &c) {
    if (c.transfers.load(std::memory_order_acquire) != 0) out.push_back(Copy(c));
  });
  return out;
}

void Reset() {
  Process().ForEach([](Cell &c) {
    c.transfers.store(0, std::memory_order_relaxed);
    c.bytes.store(0, std::memory_order_relaxed);
    c.nanos.store(0, std::memory_order_relaxed);
    for (auto &n : c.counts) n.store(0, std::memory_order_relaxed);
    for (auto &n : c.errors) n.store(0, std::memory_order_relaxed);
  });
}

std::string SeriesJson(const Series &s) {
  std::string out =
      "{\"transfers\":" + std::to_string(s.transfers) + ",\"bytes\":" + std::to_string(s.bytes) + ",\"errors\":{";
  for (size_t i = 0; i < s.errors.size(); ++i)
    out += (i ? "," : "") + Quoted(s.errors[i].first) + ":" + std::to_string(s.errors[i].second);
  out += "},\"seconds\":" + Number(s.seconds()) + ",\"latency_buckets\":{";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < kBuckets; ++i) {
    cumulative += s.counts[i];
    out += (i ? "," : "") + Quoted(kBucketText[i]) + ":" + std::to_string(cumulative);
  }
  out += "}";
  for (const auto &q : {std::make_pair("p50_s", 0.5), std::make_pair("p99_s", 0.99)}) {
    const double v = s.Quantile(q.second);
    out += ",\"" + std::string(q.first) + "\":";
    if (v < 0) {
      out += "null";
    } else if (std::isinf(v)) {
      out += Number(v);
    } else {
      for (size_t i = 0; i < kBuckets; ++i)  // a bound: written as Python writes it
        if (static_cast<double>(kBucketNs[i]) / 1e9 == v) out += kBucketText[i];
    }
  }
  return out + "}";
}

std::string StatsJson(uint64_t self_cluster_id, int32_t role, uint64_t peer, bool told) {
  std::string own;
  if (told && IsNamed(peer))
    for (size_t op = 0; op < kOps; ++op) {
      const Cell *c = Process().Lookup(static_cast<Op>(op), peer);
      if (c == nullptr || c->transfers.load(std::memory_order_acquire) == 0) continue;
      own += (own.empty() ? "" : ",") + Quoted(OpName(c->op)) + ":" + SeriesJson(Copy(*c));
    }
  std::string out = "{\"cluster_id\":" + std::to_string(self_cluster_id) + ",\"role\":" + std::to_string(role) +
                    ",\"total\":{" + own + "},\"links\":{";
  if (!own.empty()) out += Quoted(std::to_string(peer)) + ":{" + own + "}";
  return out + "}}";
}

}  // namespace metrics
}  // namespace datadist

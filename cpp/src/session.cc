#include "session.h"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "addr.h"
#include "link.h"
#include "metrics.h"
#include "registry.h"
#include "threads.h"

namespace datadist {

namespace {

std::atomic<int> g_fail_thread_starts{0};

// A thread running `fn`, or std::system_error as std::thread throws when none can be made
// (and as FailThreadStarts makes it for tests).
std::thread StartThread(std::function<void()> fn) {
  for (int n = g_fail_thread_starts.load(); n > 0; n = g_fail_thread_starts.load())
    if (g_fail_thread_starts.compare_exchange_weak(n, n - 1))
      throw std::system_error(EAGAIN, std::generic_category(), "no thread could be started (test)");
  return std::thread(std::move(fn));
}

// Runs `fn`, turning whatever it throws into `out` (the C++ face's rule for every entry point).
void Capture(const std::function<void()> &fn, Outcome &out) {
  try {
    fn();
  } catch (const Error &e) {
    out.code = e.code();
    out.why = e.what();
  } catch (const std::bad_alloc &) {
    out.code = llm_datadist::LLM_OUT_OF_MEMORY;
    out.why = "out of memory";
  } catch (const std::exception &e) {
    out.code = llm_datadist::LLM_FAILED;
    out.why = e.what();
  }
}

metrics::Op OpOf(const Call &call) { return call.write ? metrics::Op::kPush : metrics::Op::kPull; }

}  // namespace

namespace testing {
void FailThreadStarts(int n) { g_fail_thread_starts = n; }
}  // namespace testing

std::vector<Outcome> EachAtOnce(size_t n, const std::function<void(size_t)> &fn, Status unstarted) {
  std::vector<Outcome> out(n);
  if (n == 1) {
    Capture([&] { fn(0); }, out[0]);
    return out;
  }
  // Joined however this returns (an exception past here would otherwise destroy joinable
  // threads: std::terminate).
  struct Joined {
    std::vector<std::thread> threads;
    ~Joined() {
      for (auto &t : threads)
        if (t.joinable()) t.join();
    }
  } joined;
  std::vector<std::thread> &threads = joined.threads;
  threads.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    try {
      threads.push_back(StartThread([&fn, &out, i] {
        EnterCoreThread("datadist-each");
        Capture([&] { fn(i); }, out[i]);
      }));
    } catch (const std::exception &e) {  // system_error, or bad_alloc copying `fn`: never terminate
      out[i].code = unstarted;
      out[i].why = std::string("could not start a thread for it (") + e.what() + "): nothing was done";
    }
  }
  for (auto &t : threads) t.join();  // before `out` is returned (moved): the threads write it
  threads.clear();
  return out;
}

std::shared_ptr<Call> Call::Make(bool write, uint64_t cluster, wire::Request req, std::vector<iovec> iov) {
  auto call = std::make_shared<Call>();
  call->write = write;
  call->cluster = cluster;
  call->req = std::move(req);
  call->iov = std::move(iov);
  for (const iovec &v : call->iov) call->bytes += v.iov_len;
  return call;
}

namespace {

void CheckRequestSize(size_t tensors, size_t runs) {
  if (static_cast<unsigned __int128>(tensors) * runs > kMaxRequestSpans)
    Invalid("the transfer names more than " + std::to_string(kMaxRequestSpans) +
            " spans (tensors x block runs); split it");
}

}  // namespace

void CheckRequestSize(const wire::Request &req) { CheckRequestSize(req.tensors.size(), req.offsets.size()); }

Session::Session(uint64_t cluster_id, int32_t role, size_t async_threads)
    : engine_(cluster_id, role), executor_(async_threads) {}

Session::~Session() { Close(0.0); }

int Session::Close(double wait_s) {
  // Queued transfers fail first; closing the links then fails the running ones at once
  // (their sockets shut down), and only then are the workers joined.
  executor_.Close();
  const int leased = engine_.Close(wait_s);
  executor_.Stop();
  return leased;
}

std::vector<Outcome> Session::LinkMany(const std::vector<Peer> &peers, Deadline deadline, bool take_peer_id) {
  std::vector<uint64_t> filed(peers.size(), 0);
  std::vector<Outcome> out = EachAtOnce(
      peers.size(),
      [&](size_t i) {
        const Peer &p = peers[i];
        filed[i] = engine_.Connect(p.cluster_id, p.host, p.port, deadline, take_peer_id, true);
      },
      llm_datadist::LLM_LINK_FAILED);
  for (size_t i = 0; i < out.size(); ++i)
    if (out[i].code == llm_datadist::LLM_SUCCESS) out[i].filed = filed[i];
  return out;
}

void Session::Unlink(uint64_t id, Deadline deadline, bool force, bool quiet_inbound) {
  auto [own, inbound] = engine_.BothEnds(id);
  if (!own && !inbound) Fail(llm_datadist::LLM_NOT_YET_LINK, "cluster " + std::to_string(id) + " is not linked");
  std::string untold;  // LLM_UNLINK_FAILED of either end, raised once both were tried
  for (const auto &link : {own, inbound}) {
    if (!link) continue;
    const bool forced = force || (quiet_inbound && link == inbound);
    try {
      link->Close(forced ? Deadline() : deadline, forced);
    } catch (const Error &e) {
      // LLM_UNLINK_FAILED: the peer was not told, our end is closed; anything else
      // (LLM_LINK_BUSY) leaves the link up.
      if (e.code() != llm_datadist::LLM_UNLINK_FAILED) throw;
      untold = e.what();
    }
    engine_.Forget(id, link);
  }
  if (!untold.empty()) Fail(llm_datadist::LLM_UNLINK_FAILED, untold);
}

std::vector<Outcome> Session::UnlinkMany(const std::vector<Peer> &peers, Deadline deadline, const UnlinkRule &rule) {
  return EachAtOnce(
      peers.size(),
      [&](size_t i) {
        const Peer &p = peers[i];
        try {
          // HIXL: politely whatever force says, the peer's own link to us without a word.
          Unlink(p.cluster_id, deadline, rule.force && !rule.hixl, rule.hixl);
        } catch (const Error &e) {
          if (e.code() != llm_datadist::LLM_NOT_YET_LINK) throw;
          // Nothing of ours to drop (CANN: "entity not found", a warning): forced or HIXL, a
          // success; otherwise CANN tells the listener, which has nothing to drop either.
          if (rule.force || rule.hixl) return;
          if (p.host.empty())
            Invalid("unlink without force needs the remote ip info of cluster " + std::to_string(p.cluster_id));
          try {
            Conn::Connect(p.host, p.port, deadline);
          } catch (const Error &dial) {
            Fail(llm_datadist::LLM_UNLINK_FAILED,
                 "cluster " + std::to_string(p.cluster_id) + " is not linked and its listener at " +
                     FormatHostPort(p.host, p.port) + " did not answer: " + dial.what());
          }
        }
      },
      llm_datadist::LLM_UNLINK_FAILED);
}

std::shared_ptr<Call> Session::MakeCall(bool write, uint64_t cluster, wire::Request req, Plan &&plan,
                                        int64_t local_cache, const Entry &local) {
  CheckRequestSize(plan.remote_tensors.size(), plan.remote_offsets.size());  // before the local spans are made
  CheckLocalSpans(plan, local.geo, local_cache);
  req.layout = local.opts.blocks ? local.geo.layout : local.geo.layout & ~uint64_t{0xFFFFFFFF};
  std::vector<iovec> iov = LocalIov(plan, local.addrs);
  // Moved, not copied: a request of 100k runs is megabytes, and every byte copied or newly
  // allocated here is paid again on each call (docs/performance.md, "Large requests").
  req.tensors = std::move(plan.remote_tensors);
  req.offsets = std::move(plan.remote_offsets);
  req.lengths = std::move(plan.lengths);
  auto call = Call::Make(write, cluster, std::move(req), std::move(iov));
  call->local_cache = local_cache;
  call->local_addrs = local.addrs;
  call->local_tensor_bytes = local.geo.tensor_bytes;
  return call;
}

std::shared_ptr<Call> Session::Prepare(bool write, uint64_t cluster, wire::Request req, const Plan &plan,
                                       int64_t local_cache) {
  // The request's size before the cache is looked up, as before: tensors x runs of them.
  CheckRequestSize(plan.remote_tensors.size(), plan.remote_offsets.size());
  const std::unique_ptr<Lease> held = engine_.registry().Hold(local_cache);
  return MakeCall(write, cluster, std::move(req), Plan(plan), local_cache, held->entry());  // immutable while held
}

std::shared_ptr<Call> Session::PreparePull(uint64_t cluster, wire::Request req, const PullSpec &spec,
                                           int64_t local_cache) {
  const std::unique_ptr<Lease> held = engine_.registry().Hold(local_cache);
  const Entry &local = held->entry();  // immutable while filed (and held)
  Plan plan;
  PlanPull(plan, local.geo, spec);
  req.unit_bytes = spec.kind == PullSpec::kBlocks ? local.geo.unit_bytes : 0;
  if (plan.whole) req.flags |= wire::kFlagWhole;
  const auto since = Clock::now();
  try {
    return MakeCall(false, cluster, std::move(req), std::move(plan), local_cache, local);
  } catch (const Error &e) {  // refused before anything moved: counted, as Run counts its own
    metrics::RecordSince(metrics::Op::kPull, cluster, 0, since, e.code());
    throw;
  }
}

std::shared_ptr<Call> Session::PreparePush(uint64_t cluster, wire::Request req, const PushSpec &spec,
                                           int64_t local_cache) {
  const std::unique_ptr<Lease> held = engine_.registry().Hold(local_cache);
  const Entry &local = held->entry();
  Plan plan;
  PlanPush(plan, local.geo, spec);
  req.unit_bytes = spec.blocks ? local.geo.unit_bytes : 0;
  const auto since = Clock::now();
  try {
    return MakeCall(true, cluster, std::move(req), std::move(plan), local_cache, local);
  } catch (const Error &e) {  // refused before anything moved: counted, as Run counts its own
    metrics::RecordSince(metrics::Op::kPush, cluster, 0, since, e.code());
    throw;
  }
}

std::vector<std::shared_ptr<Call>> Session::PrepareLayerPushes(uint64_t cluster, const wire::Request &req,
                                                               const LayerPushSpec &spec, int64_t local_cache) {
  const std::unique_ptr<Lease> held = engine_.registry().Hold(local_cache);
  const Entry &local = held->entry();  // immutable while held
  Plan spans;
  PlanLayerSpans(spans, LayerPushView(local.geo, local.opts.blocks, spec.kind), spec);
  const uint64_t n = spec.tensors_per_layer;
  const bool raw = !spec.dst_addrs.empty();
  if (n == 0 || n > (uint64_t{1} << 32) || spec.layers == 0)
    Invalid("a layer push needs >= 1 layer of 1 to 2**32 tensors");
  // The local tensors are checked with the spans (CheckLocalSpans); the remote ones travel as u32.
  using U128 = unsigned __int128;
  const U128 limit = U128{1} << 32;
  const U128 local_top = (U128{spec.src_first} + spec.layers) * n;
  const U128 remote_top = raw ? 1 : (U128{spec.dst_first} + spec.layers) * n;
  if (local_top > limit || remote_top > limit) Invalid("the layer push's layers reach past the largest tensor index");
  if (raw) {
    if (spec.dst_addrs.size() != spec.layers * n)
      Invalid("expect " + std::to_string(spec.layers * n) + " dst_addrs, but got " +
              std::to_string(spec.dst_addrs.size()));
    for (uint64_t addr : spec.dst_addrs) CheckAddressSpans(spans, addr);  // all before any call
  }
  std::vector<std::shared_ptr<Call>> calls;
  calls.reserve(raw ? spec.dst_addrs.size() : spec.layers);
  const auto since = Clock::now();
  try {
    for (uint64_t k = 0; k < spec.layers; ++k) {
      const uint64_t src = (spec.src_first + k) * n;
      if (raw) {
        for (uint64_t t = 0; t < n; ++t) {
          Plan plan = spans;
          plan.remote_tensors = {0};
          plan.local_tensors = {static_cast<uint32_t>(src + t)};
          for (uint64_t &off : plan.remote_offsets) off += spec.dst_addrs[k * n + t];
          calls.push_back(MakeCall(true, cluster, req, std::move(plan), local_cache, local));
        }
        continue;
      }
      Plan plan = spans;
      const uint64_t dst = (spec.dst_first + k) * n;
      plan.remote_tensors.resize(n);
      plan.local_tensors.resize(n);
      for (uint64_t t = 0; t < n; ++t) {
        plan.remote_tensors[t] = static_cast<uint32_t>(dst + t);
        plan.local_tensors[t] = static_cast<uint32_t>(src + t);
      }
      calls.push_back(MakeCall(true, cluster, req, std::move(plan), local_cache, local));
    }
  } catch (const Error &e) {  // refused before anything moved: counted, as Run counts its own
    metrics::RecordSince(metrics::Op::kPush, cluster, 0, since, e.code());
    throw;
  }
  return calls;
}

std::unique_ptr<Lease> Session::HoldLocal(const Call &call) {
  if (call.local_cache < 0) return nullptr;
  std::unique_ptr<Lease> held = engine_.registry().Hold(call.local_cache);
  // The spans lie in these tensors: a cache filed anew under the id (the C++ API's Add may
  // choose ids) with other memory is not the one they were checked against.
  const Entry &e = held->entry();
  if (e.geo.tensor_bytes != call.local_tensor_bytes || e.addrs != call.local_addrs)
    Fail(llm_datadist::LLM_KV_CACHE_NOT_EXIST,
         "cache " + std::to_string(call.local_cache) + " is not the cache the transfer was prepared for");
  return held;
}

void Session::Move(const Call &call, Deadline deadline) {
  CheckRequestSize(call.req);
  auto link = engine_.GetLink(call.cluster);
  if (call.write)
    link->Write(call.req, call.iov, deadline);
  else
    link->Read(call.req, call.iov, deadline);
}

void Session::Run(const Call &call, Deadline deadline, Clock::time_point since) {
  metrics::Timed(OpOf(call), call.cluster, call.bytes, since, [&] {
    const std::unique_ptr<Lease> held = HoldLocal(call);  // released when the transfer ends, whatever its outcome
    Move(call, deadline);
  });
}

void Session::Transfer(bool write, uint64_t cluster, wire::Request req, const Plan &plan, const Geometry &local,
                       const std::vector<uint64_t> &local_addrs, Deadline deadline) {
  const auto since = Clock::now();
  std::shared_ptr<Call> call;
  try {
    CheckRequestSize(req);  // before the local spans are made: tensors x runs of them
    CheckLocalSpans(plan, local, -1);
    call = Call::Make(write, cluster, std::move(req), LocalIov(plan, local_addrs));
  } catch (const Error &e) {
    metrics::RecordSince(write ? metrics::Op::kPush : metrics::Op::kPull, cluster, 0, since, e.code());
    throw;
  }
  Run(*call, deadline, since);
}

std::shared_ptr<Task> Session::Submit(std::shared_ptr<const Call> call, Deadline deadline, Clock::time_point since) {
  const metrics::Op op = OpOf(*call);
  std::shared_ptr<Lease> held;  // the task's, until the transfer ends (Executor drops its closure first)
  try {
    held = HoldLocal(*call);
  } catch (const Error &e) {  // nothing issued: counted, and the caller's error
    metrics::RecordSince(op, call->cluster, 0, since, e.code());
    throw;
  }
  std::shared_ptr<Link> link = call->write ? nullptr : engine_.FindLink(call->cluster);
  if (link && call->bytes <= kInlineBytes) {
    try {
      CheckRequestSize(call->req);
      if (link->ReadLeasedNow(call->req, call->iov)) {
        metrics::RecordSince(op, call->cluster, call->bytes, since, llm_datadist::LLM_SUCCESS);
        return Task::Ended(0, "");
      }
    } catch (const Error &e) {  // as a worker would end the task
      metrics::RecordSince(op, call->cluster, 0, since, e.code());
      return Task::Ended(e.code(), e.what(), e.kind());
    } catch (const std::exception &e) {
      metrics::RecordSince(op, call->cluster, 0, since, llm_datadist::LLM_FAILED);
      return Task::Ended(llm_datadist::LLM_FAILED, e.what());
    }
  }
  // A streamed pull (within the request cap: a bigger one fails on a worker, as ever) joins
  // its link's pipe, unless the workers are closed (the executor's own refusal then).
  const wire::Request &req = call->req;
  if (link && link->Streams() && !(req.flags & wire::kFlagChecksum) &&
      static_cast<unsigned __int128>(req.tensors.size()) * req.offsets.size() <= kMaxRequestSpans &&
      !executor_.closed())
    if (auto task = Pipeline(call, held, deadline, since)) return task;
  const uint64_t cluster = call->cluster;
  try {
    return executor_.Submit([this, c = std::move(call), held = std::move(held), deadline, since] {
      metrics::Timed(OpOf(*c), c->cluster, c->bytes, since, [&] { Move(*c, deadline); });
    });
  } catch (const Error &e) {  // not issued: counted as a transfer that failed
    metrics::RecordSince(op, cluster, 0, since, e.code());
    throw;
  } catch (const std::exception &e) {  // no worker could be started: the task's code, counted
    metrics::RecordSince(op, cluster, 0, since, llm_datadist::LLM_FAILED);
    return Task::Ended(llm_datadist::LLM_FAILED, std::string("the transfer could not be queued: ") + e.what());
  }
}

struct Session::Pipe {
  struct Pull {
    std::shared_ptr<const Call> call;
    std::shared_ptr<Lease> held;  // the call's local cache, until the pull ends
    Clock::time_point since;
    std::shared_ptr<Task> task;
    Link::PipedRead read;  // into `call`
    bool ended = false;    // the drain's thread only
    /// Counts the pull (as Run counts a transfer) and ends its task, what it held let go first.
    void End(uint64_t cluster, Status code, const std::string &why, ErrorKind kind) {
      metrics::RecordSince(metrics::Op::kPull, cluster, code == llm_datadist::LLM_SUCCESS ? call->bytes : 0, since,
                           code);
      std::shared_ptr<Task> t = std::move(task);
      held.reset();
      call.reset();
      ended = true;
      t->Finish(code, why, kind);
    }
  };
  std::deque<Pull> queue;  // in issue order; ended ones popped from the front by the drain
  bool draining = false;   // a worker was given Drain for it
};

std::shared_ptr<Task> Session::Pipeline(std::shared_ptr<const Call> &call, std::shared_ptr<Lease> &held,
                                        Deadline deadline, Clock::time_point since) {
  auto task = Task::Pending();
  const uint64_t cluster = call->cluster;
  std::shared_ptr<Pipe> start;
  {
    std::lock_guard<std::mutex> lock(pipes_mu_);
    std::shared_ptr<Pipe> &pipe = pipes_[cluster];
    if (!pipe) pipe = std::make_shared<Pipe>();
    // A pull due before the last one queued would wait for pulls that may run past its own
    // deadline: it waits for the link on a worker instead, under that deadline (LLM_LINK_BUSY).
    if (!pipe->queue.empty() && deadline < pipe->queue.back().read.deadline) return nullptr;
    Pipe::Pull &p = pipe->queue.emplace_back();
    p.read = {&call->req, &call->iov, deadline};
    p.call = std::move(call);
    p.held = std::move(held);
    p.since = since;
    p.task = task;
    if (!pipe->draining) {
      pipe->draining = true;
      start = pipe;
    }
  }
  if (!start) return task;  // the worker on the pipe takes it
  // The pipe's pulls end if the worker's closure is dropped unrun (the engine closed with it
  // queued, or it could not be queued), as the executor ends a transfer it never started.
  struct Ran {
    Session *session = nullptr;
    uint64_t cluster = 0;
    std::shared_ptr<Pipe> pipe;
    bool ran = false;
    Status code = ge::LLM_ENGINE_FINALIZED;
    std::string why = "the engine was finalized before the transfer started";
    ~Ran() {
      if (!ran) session->Unrun(cluster, pipe, code, why);
    }
  };
  auto ran = std::make_shared<Ran>();
  ran->session = this;
  ran->cluster = cluster;
  ran->pipe = std::move(start);
  try {
    const auto worker = executor_.Submit([ran] {
      ran->ran = true;
      ran->session->Drain(ran->cluster, ran->pipe);
    });
    if (worker->Done() && worker->code() != llm_datadist::LLM_SUCCESS) {  // refused: the engine closed
      ran->code = worker->code();
      ran->why = worker->message();
    }
  } catch (const std::exception &e) {  // no worker could be started
    ran->code = llm_datadist::LLM_FAILED;
    ran->why = std::string("the transfer could not be queued: ") + e.what();
  }
  return task;
}

void Session::Unrun(uint64_t cluster, const std::shared_ptr<Pipe> &pipe, Status code, const std::string &why) {
  std::deque<Pipe::Pull> dropped;
  {
    std::lock_guard<std::mutex> lock(pipes_mu_);
    dropped.swap(pipe->queue);
    pipe->draining = false;
    auto it = pipes_.find(cluster);
    if (it != pipes_.end() && it->second == pipe) pipes_.erase(it);
  }
  for (Pipe::Pull &p : dropped) p.End(cluster, code, why, ErrorKind::kGeneral);
}

void Session::Drain(uint64_t cluster, const std::shared_ptr<Pipe> &pipe) {
  for (;;) {
    // Once the workers are closed, what waits here ends as a queued transfer does.
    const bool closed = executor_.closed();
    std::deque<Pipe::Pull> dropped;
    bool done = false;
    {
      std::lock_guard<std::mutex> lock(pipes_mu_);
      while (!pipe->queue.empty() && pipe->queue.front().ended) pipe->queue.pop_front();
      if (closed) dropped.swap(pipe->queue);
      if (pipe->queue.empty()) {
        done = true;
        pipe->draining = false;
        auto it = pipes_.find(cluster);
        if (it != pipes_.end() && it->second == pipe) pipes_.erase(it);
      }
    }
    for (Pipe::Pull &p : dropped)
      p.End(cluster, ge::LLM_ENGINE_FINALIZED, "the engine was finalized before the transfer started",
            ErrorKind::kGeneral);
    if (done) return;
    // The front pull from here on is still in the queue (Submit only appends).
    const auto pull = [&](size_t i) -> Pipe::Pull * {
      std::lock_guard<std::mutex> lock(pipes_mu_);
      return i < pipe->queue.size() ? &pipe->queue[i] : nullptr;
    };
    size_t handed = 0;
    try {
      const std::shared_ptr<Link> link = engine_.GetLink(cluster);  // the one filed now, as Move looks it up
      link->ReadPipelined(
          [&](size_t i) -> const Link::PipedRead * {
            Pipe::Pull *p = pull(i);
            if (!p) return nullptr;
            if (i + 1 > handed) handed = i + 1;
            return &p->read;
          },
          [&](size_t i, const Error *e) {
            if (e)
              pull(i)->End(cluster, e->code(), e->what(), e->kind());
            else
              pull(i)->End(cluster, llm_datadist::LLM_SUCCESS, "", ErrorKind::kGeneral);
          });
    } catch (const Error &e) {  // no link (LLM_NOT_YET_LINK): the front pull's outcome, as Move's
      if (handed == 0) handed = 1;
      for (size_t i = 0; i < handed; ++i)
        if (Pipe::Pull *p = pull(i); !p->ended) p->End(cluster, e.code(), e.what(), e.kind());
    } catch (const std::exception &e) {  // bad_alloc: every pull handed and not ended fails
      if (handed == 0) handed = 1;
      for (size_t i = 0; i < handed; ++i)
        if (Pipe::Pull *p = pull(i); !p->ended)
          p->End(cluster, llm_datadist::LLM_FAILED, e.what(), ErrorKind::kGeneral);
    }
  }
}

std::shared_ptr<LayerRun> Session::Layers(size_t jobs, size_t steps, size_t width, double step_timeout_s) {
  return std::make_shared<LayerRun>(*this, jobs, steps, width, step_timeout_s);
}

LayerRun::LayerRun(Session &session, size_t jobs, size_t steps, size_t width, double step_timeout_s)
    : session_(session),
      width_(width == 0 ? 1 : width),
      step_timeout_s_(step_timeout_s),
      steps_(steps),
      last_(jobs, 0),
      results_(jobs) {}

void LayerRun::Put(size_t step, Entry e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (gone_ > 0 || closed_) Invalid("a layer-wise run takes its transfers before its first step goes");
  if (e.job >= last_.size())
    Invalid("destination " + std::to_string(e.job) + " out of range: the run has " + std::to_string(last_.size()));
  if (step >= steps_.size())
    Invalid("step " + std::to_string(step) + " out of range: the run has " + std::to_string(steps_.size()));
  if (last_[e.job] < step + 1) last_[e.job] = step + 1;
  steps_[step].entries.push_back(std::move(e));
  merge_known_ = false;
}

void LayerRun::Add(size_t step, size_t job, std::shared_ptr<const Call> call) {
  if (!call) Invalid("a layer-wise run's transfer is missing");
  Entry e;
  e.job = job;
  e.call = std::move(call);
  Put(step, std::move(e));
}

void LayerRun::AddAll(size_t first, size_t job, const std::vector<std::shared_ptr<const Call>> &calls,
                      size_t per_step) {
  if (per_step == 0) Invalid("a layer-wise run's destination has no calls a step");
  if (calls.empty()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (gone_ > 0 || closed_) Invalid("a layer-wise run takes its transfers before its first step goes");
  if (job >= last_.size())
    Invalid("destination " + std::to_string(job) + " out of range: the run has " + std::to_string(last_.size()));
  const size_t steps = (calls.size() + per_step - 1) / per_step;
  if (first >= steps_.size() || steps > steps_.size() - first)
    Invalid("steps " + std::to_string(first) + "-" + std::to_string(first + steps - 1) + " out of range: the run has " +
            std::to_string(steps_.size()));
  for (const auto &call : calls)
    if (!call) Invalid("a layer-wise run's transfer is missing");
  for (size_t i = 0; i < calls.size(); ++i) {
    Entry e;
    e.job = job;
    e.call = calls[i];
    steps_[first + i / per_step].entries.push_back(std::move(e));
  }
  if (last_[job] < first + steps) last_[job] = first + steps;
  merge_known_ = false;
}

void LayerRun::AddRefusal(size_t step, size_t job, Status code, std::string why) {
  Entry e;
  e.job = job;
  e.code = code == llm_datadist::LLM_SUCCESS ? llm_datadist::LLM_FAILED : code;
  e.why = std::move(why);
  Put(step, std::move(e));
}

bool LayerRun::Go(size_t step) {
  std::unique_lock<std::mutex> lock(mu_);
  if (abandoned_) return true;  // the caller gave up: nothing more runs, whatever is let go
  if (closed_ || step != gone_ || step >= steps_.size())
    Invalid("layer-wise step " + std::to_string(step) + " let go out of order (next: " + std::to_string(gone_) +
            " of " + std::to_string(steps_.size()) + (closed_ ? ", closed" : "") + ")");
  if (!merge_known_) KnowMerges();
  ++gone_;
  Kick(lock);
  return stopped_ || halted_;
}

void LayerRun::Refuse(size_t step, Status code, std::string why) {
  std::unique_lock<std::mutex> lock(mu_);
  if (abandoned_) return;  // every outcome is settled already
  if (closed_ || step != gone_ || step >= steps_.size())
    Invalid("layer-wise step " + std::to_string(step) + " refused out of order");
  Step &s = steps_[step];
  s.refused = true;
  s.code = code == llm_datadist::LLM_SUCCESS ? llm_datadist::LLM_FAILED : code;
  s.why = std::move(why);
  ++gone_;
  closed_ = true;  // nothing after a refusal
  Kick(lock);      // settled in order, as a step that ran (a worker runs nothing for it)
  Notify();        // closed: over already when a failure stopped the run before
}

void LayerRun::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  Notify();
}

void LayerRun::Abandon(Status code, std::string why) {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = stopped_ = halted_ = abandoned_ = true;
  for (size_t k = 0; k < steps_.size() && k < gone_; ++k)
    for (const Entry &e : steps_[k].entries)
      if (!results_[e.job].settled) Settle(e.job, code, why);
  Notify();
}

void LayerRun::Notify() {
  ended_cv_.notify_all();
  if (Over() || abandoned_) over_cv_.notify_all();
}

bool LayerRun::Stopped() {
  std::lock_guard<std::mutex> lock(mu_);
  return stopped_ || halted_;
}

size_t LayerRun::Ended() {
  std::lock_guard<std::mutex> lock(mu_);
  return next_;
}

size_t LayerRun::steps() {
  std::lock_guard<std::mutex> lock(mu_);
  return steps_.size();
}

uint64_t LayerRun::calls_run() {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_run_;
}

uint64_t LayerRun::requests_run() {
  std::lock_guard<std::mutex> lock(mu_);
  return requests_run_;
}

bool LayerRun::Merges() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!merge_known_) KnowMerges();
  for (uint8_t m : merge_next_)
    if (m) return true;
  return false;
}

bool LayerRun::CanMerge(const Call &a, const Call &b) {
  const wire::Request &x = a.req, &y = b.req;
  return a.write == b.write && a.cluster == b.cluster && (x.kind == wire::kCacheId || x.kind == wire::kBlocksKey) &&
         x.kind == y.kind && x.a == y.a && x.b == y.b && x.c == y.c && x.unit_bytes == y.unit_bytes &&
         x.layout == y.layout && x.flags == y.flags && !(x.flags & (wire::kFlagWhole | wire::kFlagChecksum)) &&
         a.local_cache == b.local_cache && a.local_tensor_bytes == b.local_tensor_bytes &&
         a.iov.size() == x.tensors.size() * x.offsets.size() && b.iov.size() == y.tensors.size() * y.offsets.size() &&
         x.offsets == y.offsets && x.lengths == y.lengths && a.local_addrs == b.local_addrs;
}

void LayerRun::KnowMerges() {
  merge_next_.assign(steps_.size(), 0);
  for (size_t k = 0; k + 1 < steps_.size(); ++k) {
    const auto &a = steps_[k].entries, &b = steps_[k + 1].entries;
    merge_next_[k] = a.size() == 1 && b.size() == 1 && a[0].call && b[0].call && a[0].job == b[0].job &&
                     CanMerge(*a[0].call, *b[0].call);
  }
  merge_known_ = true;
}

bool LayerRun::WaitEnded(size_t steps, Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  return ended_cv_.wait_until(lock, deadline, [&] { return next_ >= steps || stopped_ || halted_ || Over(); });
}

bool LayerRun::Wait(Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  return over_cv_.wait_until(lock, deadline, [&] { return Over() || abandoned_; });
}

std::vector<LayerRun::Result> LayerRun::Results() {
  std::lock_guard<std::mutex> lock(mu_);
  return results_;
}

bool LayerRun::Over() const { return closed_ && in_flight_ == 0 && (stopped_ || next_ >= gone_); }

void LayerRun::Settle(size_t job, Status code, std::string why) {
  Result &r = results_[job];
  r.settled = true;
  r.code = code;
  r.why = std::move(why);
}

void LayerRun::Kick(std::unique_lock<std::mutex> &lock) {
  std::vector<size_t> start;
  while (!halted_ && !stopped_ && started_ < gone_ && running_ < width_) {
    ++running_;
    ++in_flight_;
    start.push_back(started_++);
  }
  // No waiter is woken here: starting a step brings neither wait's end nearer (StepEnded,
  // Close, Refuse and Abandon wake them).
  if (start.empty()) return;
  lock.unlock();
  for (size_t k : start) {
    // Runs Unrun when the worker's closure is dropped unrun (the engine closed with it
    // queued, or already closed): the step fails, and the run stops.
    struct Ran {
      std::shared_ptr<LayerRun> run;
      size_t step = 0;
      bool ran = false;
      ~Ran() {
        if (!ran) run->Unrun(step);
      }
    };
    auto ran = std::make_shared<Ran>();
    ran->run = shared_from_this();
    ran->step = k;
    try {
      session_.executor().Submit([ran] {
        ran->ran = true;
        ran->run->RunStep(ran->step);
      });
    } catch (const std::exception &) {  // bad_alloc queueing: the closure (and `ran`) went unrun
    }
  }
  lock.lock();
}

void LayerRun::Unrun(size_t k) {
  std::unique_lock<std::mutex> lock(mu_);
  Step &step = steps_[k];
  step.failed = 0;
  step.fail_code = ge::LLM_ENGINE_FINALIZED;
  step.fail_why = "the engine was finalized before the layer was sent";
  halted_ = true;
  --running_;
  StepEnded(k);
  Kick(lock);
}

size_t LayerRun::Extend(size_t k) {
  size_t end = k + 1;
  const bool rest = k == rest_;  // the rest of a split batch: claimed whole
  if (rest) rest_ = SIZE_MAX;
  if (steps_[k].refused || k >= merge_next_.size() || !merge_next_[k] || started_ != end) return end;
  // The next steps let go and not started (no other worker took one: started_ == k + 1),
  // while each merges with the one before and the batch stays within its caps.
  uint64_t spans = steps_[k].entries[0].call->iov.size();
  uint64_t bytes = steps_[k].entries[0].call->bytes;
  size_t cap = end;
  while (cap < gone_ && merge_next_[cap - 1] && !steps_[cap].refused) {
    const Call &c = *steps_[cap].entries[0].call;
    if (spans + c.iov.size() > kMergeSpans || bytes + c.bytes > kMergeBytes) break;
    spans += c.iov.size();
    bytes += c.bytes;
    ++cap;
  }
  // Split between the workers: this one takes its share of the bytes, the rest waits for the
  // next worker free (kSplitBytes).
  uint64_t share = bytes;
  if (width_ > 1 && !rest && cap > end && bytes >= 2 * kSplitBytes) share = (bytes + width_ - 1) / width_;
  uint64_t taken = steps_[k].entries[0].call->bytes;
  while (end < cap && taken < share) {
    taken += steps_[end].entries[0].call->bytes;
    ++started_;
    ++in_flight_;
    ++end;
  }
  if (end < cap) rest_ = end;
  return end;
}

void LayerRun::RunBatch(std::unique_lock<std::mutex> &lock, size_t first, size_t end) {
  // One destination's calls, one a step (KnowMerges): sent as one request.
  const size_t job = steps_[first].entries[0].job;
  if (stopped_ || results_[job].settled) return;  // abandoned meanwhile
  // Each step may take its own timeout: the batch gets what its steps would have had one
  // after another (one step's deadline would fail a batch that a slow link carries step by step).
  const auto since = Clock::now();
  const double step_s = step_timeout_s_ < 0 ? 0 : step_timeout_s_;
  const Deadline deadline = since + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(step_s * static_cast<double>(end - first)));
  calls_run_ += end - first;
  ++requests_run_;
  lock.unlock();
  // The steps' entries no longer change (added before the first Go): read without the lock.
  Outcome merged;
  Capture(
      [&] {
        const Call &c0 = *steps_[first].entries[0].call;
        Call call;
        call.write = c0.write;
        call.cluster = c0.cluster;
        call.req = c0.req;  // the key, unit bytes, layout, flags and spans: the same in every step
        call.local_cache = c0.local_cache;
        call.local_addrs = c0.local_addrs;
        call.local_tensor_bytes = c0.local_tensor_bytes;
        size_t tensors = 0, iovs = 0;
        for (size_t k = first; k < end; ++k) {
          const Call &c = *steps_[k].entries[0].call;
          tensors += c.req.tensors.size();
          iovs += c.iov.size();
        }
        call.req.tensors.reserve(tensors);
        call.iov.reserve(iovs);
        for (size_t k = first + 1; k < end; ++k) {
          const Call &c = *steps_[k].entries[0].call;
          call.req.tensors.insert(call.req.tensors.end(), c.req.tensors.begin(), c.req.tensors.end());
        }
        for (size_t k = first; k < end; ++k) {
          const Call &c = *steps_[k].entries[0].call;
          call.iov.insert(call.iov.end(), c.iov.begin(), c.iov.end());  // tensor-major, as the request
          call.bytes += c.bytes;
        }
        session_.Run(call, deadline, since);
      },
      merged);
  lock.lock();
  if (merged.code == llm_datadist::LLM_SUCCESS) return;
  // Replayed a step at a time: the failure lands on the step that fails alone (the steps
  // before it sent again: the same bytes), and nothing after it runs.
  for (size_t k = first; k < end && !stopped_ && !results_[job].settled; ++k) {
    Step &step = steps_[k];
    ++requests_run_;
    Outcome out;
    lock.unlock();
    // Each replayed step under a deadline of its own, as it would have run alone (the batch's
    // may be spent: a slow batch that timed out).
    const auto at = Clock::now();
    const Deadline own = at + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(step_s));
    Capture([&] { session_.Run(*step.entries[0].call, own, at); }, out);
    lock.lock();
    if (out.code != llm_datadist::LLM_SUCCESS) {
      if (k == first) out = std::move(merged);  // the merged request's own failure
      step.failed = 0;
      step.fail_code = out.code;
      step.fail_why = std::move(out.why);
      halted_ = true;
      return;
    }
  }
}

void LayerRun::RunStep(size_t k) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    const size_t end = Extend(k);
    if (rest_ == end && running_ < width_) Kick(lock);  // a split batch's rest: another worker now
    if (end > k + 1) {
      RunBatch(lock, k, end);
    } else if (!steps_[k].refused) {
      Step &step = steps_[k];  // its entries no longer change: added before the first Go
      const auto since = Clock::now();
      const Deadline deadline = since + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double>(step_timeout_s_ < 0 ? 0 : step_timeout_s_));
      for (size_t i = 0; i < step.entries.size() && !stopped_; ++i) {
        const Entry &e = step.entries[i];
        if (results_[e.job].settled) continue;  // abandoned meanwhile
        Outcome out;
        if (e.call) {
          ++calls_run_;
          ++requests_run_;
          lock.unlock();
          Capture([&] { session_.Run(*e.call, deadline, since); }, out);
          lock.lock();
        } else {
          out.code = e.code;
          out.why = e.why;
        }
        if (out.code != llm_datadist::LLM_SUCCESS) {
          step.failed = i;
          step.fail_code = out.code;
          step.fail_why = std::move(out.why);
          halted_ = true;  // no step starts after a failure, whichever step it is in
          break;
        }
      }
    }
    for (size_t j = k; j < end; ++j) StepEnded(j);
    // The next step let go and not started, run by this worker: no hand-over to another
    // (a wake-up per layer) while the caller keeps ahead.
    if (halted_ || stopped_ || started_ >= gone_) break;
    k = started_++;
    ++in_flight_;
  }
  --running_;
  Kick(lock);
}

void LayerRun::StepEnded(size_t k) {
  steps_[k].ended = true;
  --in_flight_;
  const size_t settled = next_;
  // Outcomes in step order: a step's failure is settled only after every step before it.
  while (next_ < started_ && steps_[next_].ended) {
    Step &step = steps_[next_];
    if (!stopped_) {
      if (step.refused) {
        for (const Entry &e : step.entries)
          if (!results_[e.job].settled) Settle(e.job, step.code, step.why);
        stopped_ = true;
      } else if (step.failed < step.entries.size()) {
        const size_t job = step.entries[step.failed].job;
        if (!results_[job].settled) Settle(job, step.fail_code, std::move(step.fail_why));
        stopped_ = true;
      } else {  // every call ran well: the destinations it ends succeed
        for (const Entry &e : step.entries)
          if (last_[e.job] == next_ + 1 && !results_[e.job].settled) Settle(e.job, llm_datadist::LLM_SUCCESS, "");
      }
    }
    ++next_;
  }
  // Each waiter woken only when its wait may be over (issue 37: the caller waiting on the run
  // was woken by every step's end, and took a CPU from the copies to go back to sleep): a
  // step settled or a failure for WaitEnded, the run over for Wait.
  if (next_ != settled || halted_ || stopped_) ended_cv_.notify_all();
  if (Over()) over_cv_.notify_all();
}

void Session::CopyLocal(const Plan &plan, const std::vector<uint64_t> &src_addrs,
                        const std::vector<uint64_t> &dst_addrs, uint64_t unit) {
  for (size_t k = 0; k < plan.local_tensors.size(); ++k) {
    const uint64_t src = src_addrs[plan.remote_tensors[k]], dst = dst_addrs[plan.local_tensors[k]];
    for (size_t i = 0; i < plan.lengths.size(); ++i) {
      const uint64_t from = src + plan.remote_offsets[i], to = dst + plan.local_offsets[i], len = plan.lengths[i];
      const bool overlap = from < to + len && to < from + len && from != to;
      const uint64_t step = overlap && unit > 0 ? unit : len;
      for (uint64_t done = 0; done < len; done += step)
        std::memmove(reinterpret_cast<void *>(to + done), reinterpret_cast<const void *>(from + done),
                     static_cast<size_t>(step < len - done ? step : len - done));
    }
  }
}

namespace {

// "the source" / "the destination" span check of CheckCopyPlan.
void CheckSide(const char *side, const std::vector<uint32_t> &tensors, const std::vector<uint64_t> &offsets,
               const std::vector<uint64_t> &lengths, const Geometry &g) {
  for (uint32_t t : tensors)
    if (t >= g.num_tensors)
      Invalid(std::string("local copy: ") + side + " tensor " + std::to_string(t) + " out of range: the " + side +
              " has " + std::to_string(g.num_tensors) + " tensors");
  if (offsets.size() != lengths.size())
    Invalid(std::string("local copy: ") + std::to_string(offsets.size()) + " " + side + " offsets for " +
            std::to_string(lengths.size()) + " lengths");
  for (size_t i = 0; i < offsets.size(); ++i)
    if (lengths[i] == 0 || lengths[i] > g.tensor_bytes || offsets[i] > g.tensor_bytes - lengths[i])
      Invalid(std::string("local copy: ") + side + " span [" + std::to_string(offsets[i]) + ", +" +
              std::to_string(lengths[i]) + ") lies outside the " + side + "'s tensors of " +
              std::to_string(g.tensor_bytes) + " bytes");
}

}  // namespace

void CheckUnfiled(const Geometry &geo, const std::vector<uint64_t> &addrs) {
  if (addrs.size() != geo.num_tensors)
    Invalid(std::to_string(addrs.size()) + " addresses given for " + std::to_string(geo.num_tensors) + " tensors");
  if (geo.units == 0 || geo.tensor_bytes % geo.units != 0 || geo.unit_bytes != geo.tensor_bytes / geo.units)
    Invalid("a cache of " + std::to_string(geo.tensor_bytes) + " bytes a tensor does not split into " +
            std::to_string(geo.units) + " units");
  for (uint64_t a : addrs) {
    if (a == 0) Invalid("tensor addresses must be non-zero");
    if (a > UINT64_MAX - geo.tensor_bytes) Invalid("a tensor passes the end of the address space");
  }
}

void CheckCopyPlan(const Plan &plan, const Geometry &src, const Geometry &dst) {
  if (plan.remote_tensors.size() != plan.local_tensors.size())
    Invalid("local copy: " + std::to_string(plan.remote_tensors.size()) + " source tensors paired with " +
            std::to_string(plan.local_tensors.size()) + " destination tensors");
  CheckSide("source", plan.remote_tensors, plan.remote_offsets, plan.lengths, src);
  CheckSide("destination", plan.local_tensors, plan.local_offsets, plan.lengths, dst);
}

uint64_t Session::CopyCaches(const CopySide &src, const CopySide &dst,
                             const std::function<void(Plan &, const Geometry &, const Geometry &)> &planner,
                             const std::function<void(uint64_t)> &before_copy) {
  std::unique_ptr<Lease> held[2];  // released when the copy ends, whatever its outcome
  const Geometry *geo[2];
  const std::vector<uint64_t> *addrs[2];
  const CopySide *sides[2] = {&src, &dst};
  for (int i = 0; i < 2; ++i) {
    if (sides[i]->cache_id >= 0) {
      held[i] = engine_.registry().Hold(sides[i]->cache_id);
      geo[i] = &held[i]->entry().geo;
      addrs[i] = &held[i]->entry().addrs;
    } else {
      CheckUnfiled(sides[i]->geo, sides[i]->addrs);
      geo[i] = &sides[i]->geo;
      addrs[i] = &sides[i]->addrs;
    }
  }
  Plan plan;
  planner(plan, *geo[0], *geo[1]);
  CheckCopyPlan(plan, *geo[0], *geo[1]);
  uint64_t bytes = 0;
  for (uint64_t len : plan.lengths) bytes += len;
  bytes *= plan.local_tensors.size();
  if (before_copy) before_copy(bytes);
  CopyLocal(plan, *addrs[0], *addrs[1], geo[1]->unit_bytes);
  return bytes;
}

uint64_t Session::CopySlot(const CopySide &src, const CopySide &dst, uint64_t src_unit, uint64_t dst_unit,
                           uint64_t offset, int64_t size, const std::function<void(uint64_t)> &before_copy) {
  return CopyCaches(
      src, dst,
      [&](Plan &plan, const Geometry &sg, const Geometry &dg) {
        PlanSlotCopy(plan, sg, dg, src_unit, dst_unit, offset, size);
      },
      before_copy);
}

uint64_t Session::CopyBlocks(const CopySide &src, const CopySide &dst, const std::vector<uint64_t> &src_blocks,
                             const std::vector<uint64_t> &dst_blocks,
                             const std::function<void(uint64_t)> &before_copy) {
  const bool same = src.cache_id >= 0 ? src.cache_id == dst.cache_id : dst.cache_id < 0 && src.addrs == dst.addrs;
  return CopyCaches(
      src, dst,
      [&](Plan &plan, const Geometry &sg, const Geometry &dg) {
        PlanBlockCopy(plan, sg, dg, src_blocks, dst_blocks, same);
      },
      before_copy);
}

}  // namespace datadist

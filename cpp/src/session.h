// The seam: the one internal API both faces call. The Python binding (cpp/python/module.cc)
// and CANN's C++ API (llm_datadist.cc) translate their arguments into these calls and these
// calls' errors into their own (exceptions, Status codes); every rule that is not argument or
// error mapping is written here once: unlinking both ends of a link, linking (and unlinking)
// many clusters at once, a transfer's link lookup, request cap, timing and counting, the
// asynchronous form with its inline small read, and local copies.
//
// Who calls: the two faces only; below it, the engine (engine.h), the asynchronous workers
// (tasks.h) and the metrics (metrics.h). Thread-safety: every method may be called from any
// thread at once. Which calls block, and up to what, is said on each; none takes the GIL
// (the binding releases it before calling). Errors are thrown as datadist::Error with their
// status code, except where a call returns per-cluster outcomes.
#ifndef DATADIST_CPP_SESSION_H_
#define DATADIST_CPP_SESSION_H_

#include <sys/uio.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine.h"
#include "errors.h"
#include "net.h"
#include "plan.h"
#include "tasks.h"
#include "wire.h"

namespace datadist {

/// One item of a many-cluster call: LLM_SUCCESS (0) or the code that item failed with, and
/// why (the core's words; "" on success).
struct Outcome {
  Status code = 0;
  std::string why;
  uint64_t filed = 0;  // LinkMany: the cluster id the link is filed under (on success)
};

/// Where one cluster of LinkMany listens, and (UnlinkMany without force) where it is told.
struct Peer {
  uint64_t cluster_id = 0;
  std::string host;  // an IP literal; "" in UnlinkMany: no address given
  uint16_t port = 0;
};

/// How UnlinkMany drops a cluster: CANN's two unlink rules.
struct UnlinkRule {
  /// Close without telling the peer (CANN's force_flag); a cluster we have no link with is
  /// then a success.
  bool force = false;
  /// HIXL's rule (HixlTransferEngine::UnlinkCluster): no remote address needed, `force`
  /// ignored, our link closed politely and the peer's link to us without a word; a cluster
  /// we have no link with is a success.
  bool hixl = false;
};

/// A READ (write false) or WRITE on the link to `cluster`: the request as the wire carries
/// it and the local spans (absolute addresses, tensor-major), made once and run any number
/// of times (Run, Submit). Immutable once made; shared by the runs in flight.
///
/// A call made by Session::Prepare (the Python binding's only way to make one) names its
/// local cache (`local_cache`): its spans were checked against that cache's geometry and made
/// from the registry's addresses, and every run holds the cache for the transfer and refuses
/// it unless it still has those addresses (`local_addrs`, `local_tensor_bytes`). A call made
/// by Call::Make (`local_cache` -1: the C++ face's Transfer, tests) leaves the memory to its
/// caller to check and keep mapped.
struct Call {
  bool write = false;
  uint64_t cluster = 0;
  wire::Request req;
  std::vector<iovec> iov;
  uint64_t bytes = 0;  // the local spans' total (Call::Make sums it)
  int64_t local_cache = -1;
  std::vector<uint64_t> local_addrs;  // the local cache's tensor bases when the call was made
  uint64_t local_tensor_bytes = 0;
  /// A call with `bytes` summed from `iov`, no local cache named. Never blocks, never throws
  /// but bad_alloc.
  static std::shared_ptr<Call> Make(bool write, uint64_t cluster, wire::Request req, std::vector<iovec> iov);
};

/// One side of a local copy (Session::CopyCaches): the registry's cache `cache_id` (>= 0),
/// or, with `cache_id` < 0, memory the caller describes but never filed (Python's
/// create_cpu_cache): its geometry and tensor bases, which the caller keeps mapped for the
/// copy (CheckUnfiled says what is refused).
struct CopySide {
  int64_t cache_id = -1;
  Geometry geo;                 // unfiled memory only
  std::vector<uint64_t> addrs;  // unfiled memory only: each tensor's base
};

/// An unfiled side's description: one non-zero base per tensor, none whose tensor would pass
/// the end of the address space, units that split the tensor (LLM_PARAM_INVALID). Never blocks.
void CheckUnfiled(const Geometry &geo, const std::vector<uint64_t> &addrs);

/// A local copy's plan against its two sides: as many source as destination tensors, each
/// index inside its side, as many offsets as lengths on both sides, and every span
/// [offset, offset + length) of >= 1 byte inside the tensor on its side (overflow-safe).
/// LLM_PARAM_INVALID naming the side and the span. Never blocks.
void CheckCopyPlan(const Plan &plan, const Geometry &src, const Geometry &dst);

/// Issued pulls up to this many bytes may run in the issuing thread (Submit).
constexpr uint64_t kInlineBytes = 64 << 10;

/// LLM_PARAM_INVALID when `req` names more spans (tensors x spans) than an owner serves in
/// one request (kMaxRequestSpans, docs/protocol.md): checked before sending. Never blocks.
void CheckRequestSize(const wire::Request &req);

class LayerRun;

class Session {
 public:
  /// An engine for `cluster_id` and `role` (not open yet: engine().Open) and the workers
  /// asynchronous transfers run on (`async_threads`, started at the first Submit).
  Session(uint64_t cluster_id, int32_t role, size_t async_threads);
  /// Close(0): queued transfers fail, links close, workers are joined.
  ~Session();
  Session(const Session &) = delete;
  Session &operator=(const Session &) = delete;

  Engine &engine() { return engine_; }
  Executor &executor() { return executor_; }

  /// Stops serving: queued asynchronous transfers fail first, then every link closes (the
  /// running transfers fail at once), the caches are dropped waiting up to `wait_s` for
  /// leases, and the workers are joined. Returns Engine::Close's count of caches still
  /// leased. Blocks up to about `wait_s`. Idempotent; the engine may be opened again (the
  /// workers may not: a Submit after Close ends at once with LLM_FAILED).
  int Close(double wait_s);

  // ---- links

  /// Links to every peer at once, each within `deadline` (a thread per peer: one dead peer
  /// does not hold up the rest), filed as Engine::Connect files them (`take_peer_id`).
  /// Returns one Outcome per peer, in order: LLM_SUCCESS with `filed`, or Connect's code
  /// (LLM_LINK_FAILED, LLM_ALREADY_LINK, LLM_PARAM_INVALID for a bad llm.LocalCommRes, ...)
  /// and why; a thread that cannot be started is LLM_LINK_FAILED for its peer. Never throws
  /// but bad_alloc. Blocks up to `deadline`. The reasons are kept for LastLinkFailure and
  /// not told on stderr: the faces tell them in their own words.
  std::vector<Outcome> LinkMany(const std::vector<Peer> &peers, Deadline deadline, bool take_peer_id);

  /// Unlinks `cluster_id` at both ends: the link we made and the peer's reverse channel to
  /// us, whichever exist. LLM_NOT_YET_LINK when neither does. Each end says BYE within
  /// `deadline` unless `force` (or, for the peer's end, `quiet_inbound`: closed without a
  /// word); a peer that could not be told is LLM_UNLINK_FAILED once both ends were tried
  /// (both are closed and forgotten); LLM_LINK_BUSY (a transfer in flight) leaves the link
  /// up. Blocks up to `deadline`.
  void Unlink(uint64_t cluster_id, Deadline deadline, bool force, bool quiet_inbound);

  /// CANN's UnlinkClusters for every peer at once (as LinkMany): per `rule`, each as Unlink,
  /// and a cluster we have no link with is LLM_SUCCESS when forced or HIXL; otherwise its
  /// listener is dialled at `host:port` as CANN tells it (success if it answers within
  /// `deadline`, LLM_UNLINK_FAILED if not, LLM_PARAM_INVALID without an address). A thread
  /// that cannot be started is LLM_UNLINK_FAILED for its cluster (the link stays up). Never
  /// throws but bad_alloc. Blocks up to `deadline`.
  std::vector<Outcome> UnlinkMany(const std::vector<Peer> &peers, Deadline deadline, const UnlinkRule &rule);

  // ---- transfers

  /// The Python binding's one way to make a transfer: `req` (its kind, key, unit bytes and
  /// flags; its spans and layout are set here) moving `plan` on the link to `cluster`, into
  /// (write false) or from local cache `local_cache` of the registry. The request's size is
  /// checked (CheckRequestSize), then every local span against the cache's geometry
  /// (CheckLocalSpans, LLM_PARAM_INVALID), and the local spans are made from the registry's
  /// addresses; the layout stated is the cache's (a blocks cache's whole tag, a contiguous
  /// one's dtype alone). LLM_KV_CACHE_NOT_EXIST for an unknown cache or one being
  /// unregistered. Never blocks (the registry's mutex only).
  std::shared_ptr<Call> Prepare(bool write, uint64_t cluster, wire::Request req, const Plan &plan, int64_t local_cache);

  /// The Python face's pull, planned here: local cache `local_cache` held (LLM_KV_CACHE_NOT_EXIST
  /// for an unknown one or one being unregistered), `spec` planned against its geometry
  /// (PlanPull: the Python API's rules and texts, LLM_PARAM_INVALID), then made as Prepare makes
  /// a call (the request's size, every local span, the layout). `req` carries the key (kind, a,
  /// b, c) and the checksum flag; the unit bytes (a block pull's: the local block size) and the
  /// whole-cache flag are set from the plan. A refusal after planning (the request's size, a
  /// local span) is counted in the metrics as a failed pull, as Run counts its own. The spec's
  /// block lists (views) are read during the call only: the call keeps its own spans. Never
  /// blocks (the registry's mutex only).
  std::shared_ptr<Call> PreparePull(uint64_t cluster, wire::Request req, const PullSpec &spec, int64_t local_cache);

  /// The Python face's push, planned here as PreparePull plans a pull: local (source) cache
  /// `local_cache` held, `spec` planned against it (PlanPush), the request's size and every
  /// local span checked; the unit bytes a blocks push states are the local block size. A
  /// refusal after planning is counted as a failed push. Never blocks.
  std::shared_ptr<Call> PreparePush(uint64_t cluster, wire::Request req, const PushSpec &spec, int64_t local_cache);

  /// transfer_cache_async's pushes of one destination, every layer's at once (the Python face,
  /// api/async_transfer.py, keeps them for the next transfer of the same layers): local (source)
  /// cache `local_cache` held (LLM_KV_CACHE_NOT_EXIST), its view (LayerPushView) and one
  /// layer's spans planned once (PlanLayerSpans: the Python face's texts), the remote tensors'
  /// u32 indices and, by raw address, every address plus every span checked (CheckAddressSpans)
  /// before any call is made; then each call made as PreparePush makes its one (the request's
  /// size, every local span). Returns one call per layer (by key) or per tensor of each layer,
  /// layer-major (by raw address). `req` carries the key and the unit bytes it states; a refusal
  /// after planning is counted as a failed push. LLM_PARAM_INVALID. Never blocks.
  std::vector<std::shared_ptr<Call>> PrepareLayerPushes(uint64_t cluster, const wire::Request &req,
                                                        const LayerPushSpec &spec, int64_t local_cache);

  /// Runs `call` on the link to its cluster: the call's local cache held for the transfer
  /// (Registry::Hold: it cannot be unregistered, nor its pool memory freed, under the copy;
  /// LLM_KV_CACHE_NOT_EXIST when it is gone or no longer has the addresses the call was made
  /// with), the request's size checked (CheckRequestSize), the link found
  /// (LLM_NOT_YET_LINK without one), Link::Read / Write within `deadline`, and the whole
  /// counted and timed from `since` in the process's metrics (op pull or push, its cluster; a
  /// refusal counts as a failed transfer). Blocks up to `deadline`; throws the transfer's
  /// error.
  void Run(const Call &call, Deadline deadline, Clock::time_point since);

  /// The C++ face's one call: `req` (its spans from `plan`) on the link to `cluster`, the
  /// local spans checked against the local cache's geometry (`local`, CheckLocalSpans, as
  /// Prepare) and made from its tensors' addresses (`local_addrs`, held by the caller) only
  /// once the request's size passed; counted and timed from now as Run (a refusal included).
  /// Blocks up to `deadline`.
  void Transfer(bool write, uint64_t cluster, wire::Request req, const Plan &plan, const Geometry &local,
                const std::vector<uint64_t> &local_addrs, Deadline deadline);

  /// Run, issued: the call's local cache is held now (LLM_KV_CACHE_NOT_EXIST, counted and
  /// thrown, when it is gone: nothing is issued) and until the transfer ends, the task
  /// owning the hold. A pull of up to kInlineBytes that a whole-cache lease of its link covers
  /// is copied now, in the caller's thread (waiting for nobody: 15-26 us less than the hand
  /// over, issue 23). A pull (not checksummed) on a link that streams (TCP, the local stream:
  /// Link::Streams) joins its link's pipe: the issued pulls of one link, run back to back by
  /// one worker (Link::ReadPipelined: their READs in flight together, each task ended as soon
  /// as its own bytes are in, with its own outcome and deadline). Anything else is queued on
  /// the workers. Returns the Task (ended already for an inline copy, and for a transfer no
  /// worker could be started for: LLM_FAILED, counted). After Close the Task ends at once
  /// with LLM_FAILED (the engine is closed); a pull still waiting in its pipe then ends
  /// LLM_ENGINE_FINALIZED, as a queued transfer does. Blocks only for the inline copy.
  std::shared_ptr<Task> Submit(std::shared_ptr<const Call> call, Deadline deadline, Clock::time_point since);

  /// transfer_cache_async's layer loop, in the core (LayerRun): `jobs` destinations, `steps`
  /// steps, each step's calls run by the workers once the caller lets it go, up to `width`
  /// steps at once, each within
  /// `step_timeout_s` of its start. Never blocks. The session must outlive the run (the
  /// binding keeps it alive).
  std::shared_ptr<LayerRun> Layers(size_t jobs, size_t steps, size_t width, double step_timeout_s);

  // ---- local copies

  /// Copies the spans of `plan` from the source tensors (`src_addrs`; the plan's remote_*
  /// side, offsets absolute in the tensor) to the destination tensors (`dst_addrs`; its
  /// local_* side), tensor pair by tensor pair, span by span in the plan's order: one
  /// memmove per span, the spans coalesced by the planner (PlanBlocks). A span whose source
  /// and destination bytes overlap (a run shifted within one cache) is copied `unit` bytes
  /// at a time in order, as copies of its blocks one by one would be. The caller has checked
  /// every span against both caches (plan.h) and holds them. Blocks on memory only.
  static void CopyLocal(const Plan &plan, const std::vector<uint64_t> &src_addrs,
                        const std::vector<uint64_t> &dst_addrs, uint64_t unit);

  /// The local copy both faces call (Python's copy_cache / copy_blocks / swap_blocks, CANN's
  /// CopyKvCache / CopyKvBlocks): both sides resolved and held for the copy (a filed cache:
  /// Registry::Hold, LLM_KV_CACHE_NOT_EXIST when it is unknown or being unregistered; the
  /// source first), `plan` made by `planner` from the two geometries (the face's own rules and
  /// words; it may throw), every span of it checked against both sides (CheckCopyPlan) before
  /// a byte moves, then copied as CopyLocal copies, the destination's unit (a block, a batch
  /// slot) the overlap rule's step. `before_copy`, if set, is called with the bytes the copy
  /// will move once the plan passed, right before the first byte moves, in the caller's thread
  /// (the binding releases the GIL there for a large copy); it must not throw. Returns the
  /// bytes copied. Blocks on memory only; never takes the GIL.
  uint64_t CopyCaches(const CopySide &src, const CopySide &dst,
                      const std::function<void(Plan &, const Geometry &src, const Geometry &dst)> &planner,
                      const std::function<void(uint64_t bytes)> &before_copy = nullptr);

  /// Both faces' slot copy (Python's copy_cache, CANN's CopyKvCache): CopyCaches planned by
  /// PlanSlotCopy (plan.h: the Python API's rules and texts) against the two held sides' geometries.
  /// Returns the bytes copied. Blocks on memory only.
  uint64_t CopySlot(const CopySide &src, const CopySide &dst, uint64_t src_unit, uint64_t dst_unit, uint64_t offset,
                    int64_t size, const std::function<void(uint64_t bytes)> &before_copy = nullptr);

  /// Both faces' block copy (Python's copy_blocks and swap_blocks, CANN's CopyKvBlocks):
  /// CopyCaches planned by PlanBlockCopy, `src_blocks[i]` -> `dst_blocks[i]`; the sides are one
  /// cache (a block may then not be both a source and a destination) when they name the same
  /// filed cache, or unfiled memory at the same tensor bases. Returns the bytes copied. Blocks
  /// on memory only.
  uint64_t CopyBlocks(const CopySide &src, const CopySide &dst, const std::vector<uint64_t> &src_blocks,
                      const std::vector<uint64_t> &dst_blocks,
                      const std::function<void(uint64_t bytes)> &before_copy = nullptr);

 private:
  /// Prepare's and PreparePull's call from `plan`, local cache `local_cache` held (`local`).
  /// Consumes `plan`: its remote side is moved into the request, not copied.
  static std::shared_ptr<Call> MakeCall(bool write, uint64_t cluster, wire::Request req, Plan &&plan,
                                        int64_t local_cache, const Entry &local);
  /// The call's local cache held (nullptr for a call that names none), or
  /// LLM_KV_CACHE_NOT_EXIST when it is gone or no longer the memory the call was made for.
  std::unique_ptr<Lease> HoldLocal(const Call &call);
  /// The transfer itself (the size check, the link, Read / Write), the local memory held.
  void Move(const Call &call, Deadline deadline);
  /// Submit's issued pulls of one cluster's link waiting to be run back to back (session.cc).
  struct Pipe;
  /// Submit, for a pull that may join its link's pipe (the hold taken): queued there (both
  /// moved from), and a worker started to drain the pipe unless one is on it. Null, nothing
  /// moved, for a pull due before the last one queued (Submit queues it on the workers: every
  /// pull queued in a pipe is due no sooner than those ahead of it, which end by their own
  /// deadlines). Never blocks.
  std::shared_ptr<Task> Pipeline(std::shared_ptr<const Call> &call, std::shared_ptr<Lease> &held, Deadline deadline,
                                 Clock::time_point since);
  /// On a worker: runs `cluster`'s pipe until it is empty (Link::ReadPipelined on the link
  /// filed now), each pull counted and its task ended as it ends.
  void Drain(uint64_t cluster, const std::shared_ptr<Pipe> &pipe);
  /// The pipe's pulls end with `code` (its worker never ran: the engine closed, or none could
  /// be queued), and the pipe is dropped.
  void Unrun(uint64_t cluster, const std::shared_ptr<Pipe> &pipe, Status code, const std::string &why);

  Engine engine_;
  Executor executor_;                                // stopped before the engine closes (its tasks use links)
  std::mutex pipes_mu_;                              // guards pipes_ and every Pipe's queue and flag
  std::map<uint64_t, std::shared_ptr<Pipe>> pipes_;  // by cluster id; dropped once empty
};

/// A layer-wise transfer run by the core (issue 37: the layer loop of transfer_cache_async
/// out of Python). The caller hands over every step's prepared calls at once (Add, AddRefusal:
/// planned once, before the first Go), then lets each step go as soon as its layer is
/// synchronized (Go: a mutex and at most one hand-over to a worker; never blocks, so the
/// binding keeps the GIL for it). The session's workers start the steps in order, up to
/// `width` at once (the layers overlap, as the caller's loop overlapped them with one
/// asynchronous transfer each; a worker that ends a step runs the next one let go itself, with
/// no hand-over), while the caller synchronizes the next layer; a step's calls
/// run in the order added (one destination after another, a destination's calls in order),
/// each within `step_timeout_s` of its step's start (Session::Run: held, counted and timed as
/// a blocking transfer). Outcomes are settled in step order.
///
/// The rules of LLM-DataDist's loop (hixl, llm_datadist v2 llm_utils: the transfer_layers method of its job class):
/// * the first failure stops the run: no later call of that step, no later step is started
///   (the steps started before it, at most `width` batches, are let end); the failing destination's outcome
///   is its code, unless a failure in an earlier step settles first;
/// * a step the caller could not synchronize (Refuse) is applied in step order, after the
///   steps before it ran: every destination of it not settled yet gets the code;
/// * a destination succeeds once its last step ran well; one never reached has no outcome.
///
/// Layers let go together are merged (issue 37): a worker starting step k takes with it the
/// steps after k let go and not started yet, as long as each is one call of the same
/// destination that CanMerge with the one before (the same link, key, spans and local cache:
/// a layer push by key, one per layer, is), up to kMergeSpans spans and kMergeBytes bytes,
/// and sends them as one request (their tensors concatenated: one system call on one host,
/// one round trip over TCP). The rules hold per step: every step of a batch starts with it
/// (the batch's deadline is `step_timeout_s` times its steps from its start: what they would
/// have had one after another), outcomes are settled per step in order, and a batch that
/// fails is replayed one step at a time, each under a `step_timeout_s` of its own, so
/// the failure lands on the step that fails alone and no step after it runs (a failure of
/// the batch's first step reports the merged request's own error: the link it broke may be
/// gone by the replay). Steps with several calls (several destinations, or a raw-address
/// layer's K and V) are never merged. With `width` > 1, steps let go together of at least
/// 2 x kSplitBytes are split: the worker takes its share (the bytes over `width`), the rest
/// is one batch for the next worker free, so a large batch copies on two CPUs on one host.
/// The two parts are two batches run at once: a failure in either lands on its own step,
/// settled in order (a failure in the first part is the outcome, whatever the second did).
///
/// Who calls: the Python binding (datadist.api.async_transfer). Thread-safe. Go, Refuse,
/// Close, Abandon and the getters never block; WaitEnded and Wait block up to their deadline.
/// No thread of it takes the GIL.
class LayerRun : public std::enable_shared_from_this<LayerRun> {
 public:
  /// One destination's outcome: settled (false: none, the original's None), its code and why.
  struct Result {
    bool settled = false;
    Status code = 0;
    std::string why;
  };

  LayerRun(Session &session, size_t jobs, size_t steps, size_t width, double step_timeout_s);
  /// Step `step` sends `call` for destination `job`. Before the first Go only
  /// (LLM_PARAM_INVALID otherwise, or for a job or step out of range).
  void Add(size_t step, size_t job, std::shared_ptr<const Call> call);
  /// Every call of destination `job` at once: `calls[i]` in step `first + i / per_step` (a
  /// destination's layers are consecutive steps; `per_step` calls a layer). As Add each, under
  /// one lock: none is added when one is refused.
  void AddAll(size_t first, size_t job, const std::vector<std::shared_ptr<const Call>> &calls, size_t per_step);
  /// Step `step` fails for destination `job` with `code` when it is reached (a call that could
  /// not be made; applied in order as a failing call would be).
  void AddRefusal(size_t step, size_t job, Status code, std::string why);
  /// Step `step` may run: steps are let go in order, each once (LLM_PARAM_INVALID otherwise).
  /// Returns Stopped() after it (the caller need not ask apart). Once abandoned, Go and Refuse
  /// do nothing (Go returns true): the loop letting steps go may not have seen it yet.
  bool Go(size_t step);
  /// Step `step` was not synchronized: its destinations not settled by then get `code`, and
  /// the run stops there (and is closed). In order, as Go.
  void Refuse(size_t step, Status code, std::string why);
  /// No more steps will be let go: the run ends once the steps let go have run.
  void Close();
  /// The caller gave up waiting (its own deadline): every destination with a step let go and
  /// no outcome yet gets `code`; no step starts (calls in flight end by their deadline, their
  /// outcomes ignored). Idempotent.
  void Abandon(Status code, std::string why);
  /// A failure was seen: no later step will run (the caller need not synchronize more).
  bool Stopped();
  /// Steps that have ended (run, failed or skipped), in order.
  size_t Ended();
  /// Blocks until `steps` steps ended, the run stopped, or `deadline`; true unless the deadline
  /// passed first.
  bool WaitEnded(size_t steps, Deadline deadline);
  /// Blocks until the run is over (closed and nothing running), abandoned (Abandon: what is
  /// still running ends by its own deadline, unwaited), or `deadline`; true once over or
  /// abandoned. The caller's synchronize waits here (datadist.api.tasks.CacheTask).
  bool Wait(Deadline deadline);
  /// Every destination's outcome (settled or not yet).
  std::vector<Result> Results();
  /// Steps, and calls run so far (tests: no more calls than the steps need; a call sent in a
  /// merged request counts once).
  size_t steps();
  uint64_t calls_run();
  /// Requests sent so far: a merged batch counts one, each call of its replay one more.
  uint64_t requests_run();
  /// Some step can be merged with the next (CanMerge): letting layers go ahead of the run pays.
  /// Never blocks.
  bool Merges();

  /// Steps of one batch at most: spans (tensors x spans, as the request cap counts them) and
  /// bytes, so that a batch stays one request and ends within a layer's deadline.
  static constexpr uint64_t kMergeSpans = 1u << 16;
  static constexpr uint64_t kMergeBytes = 64ull << 20;
  /// Steps let go together and at least twice this many bytes are split between the run's
  /// workers (width > 1): a worker claims its share (the bytes over the width), the rest is
  /// left for the next worker free, started now if one may be. Each part is one request: on
  /// one host the copy runs on as many CPUs as parts (a merged batch copied on one before).
  static constexpr uint64_t kSplitBytes = 2ull << 20;
  /// `b` can follow `a` in one request: the same direction, link, key (by cache id or
  /// BlocksCacheKey), unit bytes, layout and flags (neither whole-cache nor checksummed), the
  /// same spans, and the same local cache at the same addresses. Never blocks.
  static bool CanMerge(const Call &a, const Call &b);

 private:
  struct Entry {
    size_t job = 0;
    std::shared_ptr<const Call> call;  // null: a refusal (code, why)
    Status code = 0;
    std::string why;
  };
  struct Step {
    std::vector<Entry> entries;
    bool refused = false;  // Refuse: not synchronized (code, why)
    Status code = 0;
    std::string why;
    bool ended = false;        // run (or refused, or dropped unrun)
    size_t failed = SIZE_MAX;  // the entry that failed, if one did
    Status fail_code = 0;
    std::string fail_why;
  };
  void Put(size_t step, Entry e);
  // Under mu_: hands the steps let go to workers, up to width_ at once (unlocks to queue).
  void Kick(std::unique_lock<std::mutex> &lock);
  void RunStep(size_t step);   // on a worker: the step, then the next ones let go
  size_t Extend(size_t step);  // under mu_: claims the steps merged with it
  void RunBatch(std::unique_lock<std::mutex> &lock, size_t first, size_t end);  // steps [first, end) merged
  void KnowMerges();                                                            // under mu_: merge_next_
  void Unrun(size_t step);                                                      // its closure was dropped unrun
  void StepEnded(size_t step);                            // under mu_: settles ended steps in order
  void Settle(size_t job, Status code, std::string why);  // under mu_
  bool Over() const;                                      // under mu_
  void Notify();                                          // under mu_: wakes each waiter whose wait may be over

  Session &session_;
  const size_t width_;
  const double step_timeout_s_;
  std::mutex mu_;
  std::condition_variable ended_cv_;  // WaitEnded's: a step settled, or a failure seen
  std::condition_variable over_cv_;   // Wait's: the run over, or abandoned
  std::vector<Step> steps_;
  std::vector<size_t> last_;  // each job's last step (+1; 0: none)
  std::vector<Result> results_;
  size_t gone_ = 0;                  // steps let go
  size_t started_ = 0;               // steps handed to a worker (or refused)
  size_t in_flight_ = 0;             // started and not ended
  size_t running_ = 0;               // workers running steps (at most width_)
  std::vector<uint8_t> merge_next_;  // step k can be merged with step k + 1
  bool merge_known_ = false;
  size_t rest_ = SIZE_MAX;  // the first step of a split batch's rest: claimed whole, not split again
  uint64_t requests_run_ = 0;
  size_t next_ = 0;  // steps settled, in order (== Ended())
  bool closed_ = false;
  bool halted_ = false;     // a failure was seen: no step starts
  bool stopped_ = false;    // a failure was settled: no outcome changes
  bool abandoned_ = false;  // Abandon: Wait returns, whatever is still running
  uint64_t calls_run_ = 0;
};

/// Runs fn(i) for every i in [0, n) at once, one thread each (n == 1: in the caller's
/// thread), and waits for all; fn's Error is its item's code and reason, anything else
/// LLM_FAILED. An item whose thread cannot be started gets `unstarted` and a reason, and
/// does not run. Blocks until every started item returned.
std::vector<Outcome> EachAtOnce(size_t n, const std::function<void(size_t)> &fn, Status unstarted);

namespace testing {
/// Tests only: the next `n` threads EachAtOnce starts fail to start (as std::thread does
/// when the system has none left). Thread-safe.
void FailThreadStarts(int n);
}  // namespace testing

}  // namespace datadist

#endif  // DATADIST_CPP_SESSION_H_

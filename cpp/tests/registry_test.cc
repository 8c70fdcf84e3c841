// The C++ Registry as the native engine uses it: every rule of the owner, the only
// implementation since the Python owner (the spec these tests were ported from: the removed
// Registry.open / open_addresses / lease_cache / settle of src/datadist/core/registry.py, the
// checks of core/engine.py, transport/fence.py) went. Each test names the Python function and
// the Python test (tests/core/test_registry.py, test_fence.py) it mirrors. The
// registry never touches memory, so most caches carry made-up addresses; the server tests at
// the end use real memory.
#include "registry.h"

#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "errors.h"
#include "lease.h"
#include "local.h"
#include "net.h"
#include "server.h"
#include "test_util.h"
#include "wire.h"

namespace {

using namespace llm_datadist;
namespace w = datadist::wire;
using datadist::CacheOptions;
using datadist::Entry;
using datadist::KeyId;
using datadist::Registry;
using ddtest::HostCache;

constexpr uint64_t kMax = UINT64_MAX;
constexpr uint64_t kMaxRequestSpansForTest = datadist::kMaxRequestSpans;
const std::vector<uint64_t> kAddrs = {0x10000, 0x20000, 0x30000, 0x40000};
const std::vector<uint32_t> kAll = {0, 1, 2, 3};
const CacheOptions kPool{true, true, false};        // allocate_cache
const CacheOptions kUser{false, true, false};       // register_cache
const CacheOptions kPrivate{false, false, false};   // register_cache(remote_accessible=False)
const CacheOptions kPoolBlocks{true, true, true};   // allocate_blocks_cache
const CacheOptions kUserBlocks{false, true, true};  // register_blocks_cache

// Python's GEO: 4 tensors of 4 slots of 256 bytes; BLOCKS: 2 tensors of 8 blocks of 64 bytes.
CacheDesc Desc(uint32_t num_tensors, std::vector<int64_t> shape) {
  CacheDesc d;
  d.placement = CachePlacement::kHost;
  d.num_tensors = num_tensors;
  d.data_type = DT_UINT8;
  d.shape = std::move(shape);
  return d;
}
const CacheDesc kGeo = Desc(4, {4, 256});
const CacheDesc kBlocks = Desc(2, {8, 64});
const std::vector<uint64_t> kBlockAddrs(kAddrs.begin(), kAddrs.begin() + 2);

KeyId K(uint64_t req, uint64_t model = 0) { return {req, model, false}; }
KeyId P(uint64_t prefix, uint64_t model = 0) { return {prefix, model, true}; }

w::Request Req(uint8_t kind, uint64_t a, uint64_t b, uint64_t c, std::vector<uint32_t> tensors, uint64_t offset,
               uint64_t length, uint64_t unit_bytes = 0) {
  w::Request r;
  r.kind = kind;
  r.a = a;
  r.b = b;
  r.c = c;
  r.tensors = std::move(tensors);
  r.offsets = {offset};
  r.lengths = {length};
  r.unit_bytes = unit_bytes;
  return r;
}
// A CacheKey on the wire: kind 1, a = req_id, b = model_id, c = prefix_id.
w::Request ByKey(uint64_t req, uint64_t model = 0, std::vector<uint32_t> tensors = kAll) {
  return Req(w::kCacheKey, req, model, kMax, std::move(tensors), 0, 256);
}
w::Request ByPrefix(uint64_t prefix, uint64_t model = 0) {
  return Req(w::kCacheKey, kMax, model, prefix, kAll, 0, 256);
}
w::Request ById(uint64_t id, uint64_t index = 0) { return Req(w::kCacheId, id, index, 0, kAll, 0, 256); }
w::Request ByModel(uint64_t model) { return Req(w::kBlocksKey, 0, model, 0, {0, 1}, 0, 64); }
w::LeaseRequest LeaseBy(uint8_t kind, uint64_t a, uint64_t b, uint32_t flags = 0) {
  w::LeaseRequest q;
  q.kind = kind;
  q.a = a;
  q.b = b;
  q.flags = flags;
  return q;
}

struct Refusal {
  Status code = LLM_SUCCESS;
  std::string msg;
  bool Says(const std::string &part) const { return msg.find(part) != std::string::npos; }
};
template <class F>
Refusal Refused(F f) {
  try {
    f();
  } catch (const datadist::Error &e) {
    return {e.code(), e.what()};
  }
  return {};
}

/// Open and settle a read, as a transfer that succeeded (or failed) does (Python's test `pull`).
void Pull(Registry &reg, const w::Request &req, bool ok = true) { reg.Open(req)->Settle(ok); }

/// The native engine's registry: model ids by map, caches under the ids Python chose.
class Native : public ::testing::Test {
 protected:
  void SetUp() override { reg.SetModelMap(true); }
  /// allocate_cache with `keys` bound to slots 0, 1, ... (Python's test `pool_cache`).
  void Pool(int64_t id, std::vector<KeyId> keys, const CacheOptions &opts = kPool) {
    reg.Add(id, kGeo, kAddrs, opts);
    std::vector<uint64_t> slots;
    for (size_t i = 0; i < keys.size(); ++i) slots.push_back(i);
    Bind(id, keys, slots);
  }
  void User(int64_t id, std::vector<KeyId> keys = {}) { Pool(id, std::move(keys), kUser); }
  /// BindKeys, the keys remembered for Consumed.
  void Bind(int64_t id, const std::vector<KeyId> &keys, const std::vector<uint64_t> &slots) {
    reg.BindKeys(id, keys, slots);
    bound_.insert(bound_.end(), keys.begin(), keys.end());
  }
  /// remove_cache_key: a key the test unbound is not a consumed one.
  void Unbind(const KeyId &key) {
    reg.UnbindKey(key);
    if (!reg.Bound(key)) bound_.erase(std::remove(bound_.begin(), bound_.end(), key), bound_.end());
  }
  /// The keys reads consumed since the last call (bound by Bind, not Bound any more, not
  /// unbound by the test), in the order they were bound: what the registry alone knows.
  std::vector<KeyId> Consumed() {
    std::vector<KeyId> out;
    for (const KeyId &k : bound_)
      if (!reg.Bound(k) && std::find(out.begin(), out.end(), k) == out.end()) out.push_back(k);
    for (const KeyId &k : out) bound_.erase(std::remove(bound_.begin(), bound_.end(), k), bound_.end());
    return out;
  }
  Registry reg;
  std::vector<KeyId> bound_;
};

// ------------------------------------------------------------------------------ 1. ids

// Python: Registry.add numbers caches 1, 2, 3 per process (test_cache_ids_count_from_one);
// the native engine files each under Python's id. A duplicate or non-positive id is a bug of
// the embedder: LLM_PARAM_INVALID (Python's InvalidArgument).
TEST_F(Native, CachesAreFiledUnderTheIdTheCallerChose) {
  reg.Add(7, kGeo, kAddrs, kUser);
  auto lease = reg.Open(ById(7, 1));
  EXPECT_EQ(lease->entry().id, 7);
  EXPECT_EQ(lease->bases[0], kAddrs[0] + 256);
  lease.reset();
  EXPECT_EQ(Refused([&] { reg.Open(ById(1)); }).code, LLM_KV_CACHE_NOT_EXIST);
  Refusal dup = Refused([&] { reg.Add(7, kGeo, kAddrs, kUser); });
  EXPECT_EQ(dup.code, LLM_PARAM_INVALID);
  EXPECT_TRUE(dup.Says("cache id 7 is in use")) << dup.msg;
  EXPECT_EQ(Refused([&] { reg.Add(0, kGeo, kAddrs, kUser); }).code, LLM_PARAM_INVALID);
  EXPECT_EQ(Refused([&] { reg.Add(-1, kGeo, kAddrs, kUser); }).code, LLM_PARAM_INVALID);
  // the C++ API's Add never takes an id in use
  reg.Add(1, kGeo, kAddrs, kUser);
  EXPECT_EQ(reg.Add(kGeo, kAddrs, {}), 2);
}

// Python: a deallocated cache keeps its id until its memory is released (its id is never
// reused there at all): an id whose cache a key still holds is in use.
TEST_F(Native, TheIdOfADeallocatedCacheIsInUseUntilReleased) {
  Pool(1, {K(1)});
  reg.Deallocate(1, false);
  EXPECT_EQ(Refused([&] { reg.Add(1, kGeo, kAddrs, kUser); }).code, LLM_PARAM_INVALID);
  Pull(reg, ByKey(1));
  EXPECT_EQ(reg.Released(), std::vector<int64_t>{1});
  reg.Add(1, kGeo, kAddrs, kUser);
}

// ------------------------------------------------------------------------------ 4. keys

// Python: registry.key_id (test_key_id_of_cache_key_fields).
TEST(RegistryKeys, KeyOfCacheKeyFields) {
  KeyId k;
  ASSERT_TRUE(datadist::KeyOf(5, kMax, 1, &k));
  EXPECT_EQ(k, K(5, 1));
  ASSERT_TRUE(datadist::KeyOf(kMax, 9, 1, &k));
  EXPECT_EQ(k, P(9, 1));
  EXPECT_FALSE(datadist::KeyOf(kMax, kMax, 1, &k));  // the padding key
}

// Python: Registry.add binds key i to slot i, padding skips a slot
// (test_key_i_binds_slot_i_and_padding_skips_a_slot).
TEST_F(Native, AKeyResolvesToItsSlot) {
  reg.Add(1, kGeo, kAddrs, kPool);
  Bind(1, {K(10), K(12)}, {0, 2});
  auto lease = reg.Open(ByKey(10));
  EXPECT_EQ(lease->bases, kAddrs);
  lease.reset();
  lease = reg.Open(ByKey(12));
  for (size_t t = 0; t < 4; ++t) EXPECT_EQ(lease->bases[t], kAddrs[t] + 2 * 256);
  EXPECT_EQ(lease->iov[0].iov_base, reinterpret_cast<void *>(kAddrs[0] + 512));
  lease.reset();
  EXPECT_EQ(Refused([&] { reg.Open(ByKey(11)); }).code, LLM_KV_CACHE_NOT_EXIST);
}

// Python: test_keys_are_per_model_id_and_cluster_id_is_not_part_of_them and
// test_prefix_keys_live_apart_from_req_ids.
TEST_F(Native, KeysArePerModelIdAndPrefixKeysLiveApart) {
  Pool(1, {K(1, 0)});
  Pool(2, {K(1, 1)});
  Pool(3, {P(1, 0)});
  EXPECT_EQ(reg.Open(ByKey(1, 0))->entry().id, 1);
  EXPECT_EQ(reg.Open(ByKey(1, 1))->entry().id, 2);
  EXPECT_EQ(reg.Open(ByPrefix(1, 0))->entry().id, 3);
}

// Python: Registry.open's CacheNotFound for a key nothing is bound to, the padding key
// included (test_open_unknown_names); the message is Python's.
TEST_F(Native, UnknownKeysAreCacheNotFound) {
  User(1, {K(1)});
  for (const w::Request &q : {ByKey(2), ByKey(1, 1), ByPrefix(1), ByKey(kMax), ById(2), ByModel(0)}) {
    Refusal r = Refused([&] { reg.Open(q); });
    EXPECT_EQ(r.code, LLM_KV_CACHE_NOT_EXIST) << r.msg;
  }
  Refusal r = Refused([&] { reg.Open(ByKey(2, 3)); });
  EXPECT_EQ(r.msg,
            "no cache bound to req_id=2 prefix_id=18446744073709551615 model_id=3 (the owner must allocate or "
            "register it with that CacheKey; a successful pull consumes it)");
}

// Python: Registry.check_keys / _check_unbound, all or nothing
// (test_a_key_already_bound_is_refused_and_nothing_is_bound, test_bad_key_lists).
TEST_F(Native, BindKeysRefusesBoundDuplicateAndOutOfRangeKeysAndBindsNothing) {
  Pool(1, {K(1)});
  reg.Add(2, kGeo, kAddrs, kPool);
  Refusal bound = Refused([&] { reg.BindKeys(2, {K(2), K(1)}, {0, 1}); });
  EXPECT_EQ(bound.code, LLM_PARAM_INVALID);
  EXPECT_TRUE(bound.Says("is already bound")) << bound.msg;
  EXPECT_EQ(Refused([&] { reg.Open(ByKey(2)); }).code, LLM_KV_CACHE_NOT_EXIST);  // nothing bound
  EXPECT_EQ(Refused([&] { reg.BindKeys(2, {K(3), K(3)}, {0, 1}); }).code, LLM_PARAM_INVALID);
  EXPECT_EQ(Refused([&] { reg.BindKeys(2, {K(3)}, {4}); }).code, LLM_PARAM_INVALID);
  EXPECT_EQ(Refused([&] { reg.BindKeys(9, {K(3)}, {0}); }).code, LLM_KV_CACHE_NOT_EXIST);
  EXPECT_EQ(Refused([&] { reg.Open(ByKey(3)); }).code, LLM_KV_CACHE_NOT_EXIST);
}

// Python: Registry._settle consumes a req_id key of a pool cache once every tensor was read
// (test_req_id_key_of_a_pool_cache_is_consumed_by_one_successful_read); Bound says so.
TEST_F(Native, OneSuccessfulReadConsumesAReqIdKeyOfAPoolCache) {
  Pool(1, {K(1), K(2)});
  Pull(reg, ByKey(1));
  EXPECT_EQ(Consumed(), std::vector<KeyId>{K(1)});
  EXPECT_TRUE(Consumed().empty());  // drained
  EXPECT_EQ(Refused([&] { reg.Open(ByKey(1)); }).code, LLM_KV_CACHE_NOT_EXIST);
  Pull(reg, ByKey(2));  // the other slot's key is untouched until read
  EXPECT_EQ(Consumed(), std::vector<KeyId>{K(2)});
}

// Python: test_layer_wise_reads_add_up_before_the_key_is_consumed.
TEST_F(Native, LayerWiseReadsAddUpBeforeTheKeyIsConsumed) {
  Pool(1, {K(1)});
  Pull(reg, ByKey(1, 0, {0, 1}));
  Pull(reg, ByKey(1, 0, {0, 1}));
  Pull(reg, ByKey(1, 0, {3}));
  EXPECT_TRUE(Consumed().empty());
  Pull(reg, ByKey(1, 0, {2}));
  EXPECT_EQ(Consumed(), std::vector<KeyId>{K(1)});
  EXPECT_EQ(Refused([&] { reg.Open(ByKey(1)); }).code, LLM_KV_CACHE_NOT_EXIST);
}

// Python: test_failed_reads_and_writes_do_not_consume (close(ok=False), close(consume=False)
// for writes); a lease ended without a verdict counts as failed (the transport closes it so).
TEST_F(Native, FailedReadsAndWritesDoNotConsume) {
  Pool(1, {K(1)});
  Pull(reg, ByKey(1), false);
  reg.Open(ByKey(1)).reset();  // no verdict: failed
  reg.OpenWrite(ByKey(1))->Settle(true);
  EXPECT_TRUE(Consumed().empty());
  Pull(reg, ByKey(1));
  EXPECT_EQ(Consumed(), std::vector<KeyId>{K(1)});
}

// Python: test_prefix_keys_are_never_consumed, test_keys_on_registered_memory_are_never_consumed
// (and remove_key is a no-op for them), test_reads_by_cache_id_do_not_consume_keys.
TEST_F(Native, PrefixKeysRegisteredMemoryAndCacheIdsAreNeverConsumed) {
  Pool(1, {P(1)});
  User(2, {K(2)});
  Pool(3, {K(3)});
  for (int i = 0; i < 3; ++i) {
    Pull(reg, ByPrefix(1));
    Pull(reg, ByKey(2));
    Pull(reg, ById(3, 0));
  }
  Unbind(K(2));
  Pull(reg, ByKey(2));
  EXPECT_TRUE(Consumed().empty());
  Pull(reg, ByKey(3));
  EXPECT_EQ(Consumed(), std::vector<KeyId>{K(3)});
}

// Python: Registry.open reserves the tensors a consuming read names; a second read of any of
// them is CacheNotFound until the first settles; a failed read drops its reservation.
TEST_F(Native, AConsumingReadReservesItsTensors) {
  Pool(1, {K(1)});
  auto first = reg.Open(ByKey(1, 0, {0, 1}));
  Refusal r = Refused([&] { reg.Open(ByKey(1, 0, {1, 2})); });
  EXPECT_EQ(r.code, LLM_KV_CACHE_NOT_EXIST);
  EXPECT_EQ(r.msg, "req_id=1 model_id=0 is being read by another request: one read consumes it");
  auto other = reg.Open(ByKey(1, 0, {2, 3}));  // other tensors: fine
  reg.Open(ById(1)).reset();                   // by cache id: no reservation
  first->Settle(false);
  first.reset();
  auto again = reg.Open(ByKey(1, 0, {0, 1}));  // the failed read let go
  again->Settle(true);
  other->Settle(true);
  EXPECT_EQ(Consumed(), std::vector<KeyId>{K(1)});
}

// Python's module docstring, rule 2: "two concurrent readers can never both consume one key".
// Readers on several threads race for one key while the embedder deallocates and polls:
// the key is consumed once, and the cache released once, after every read ended.
TEST_F(Native, ConcurrentReadersConsumeAKeyOnce) {
  for (int round = 0; round < 20; ++round) {
    const int64_t id = round + 1;
    Pool(id, {K(1)});
    std::atomic<int> opened{0}, refused{0};
    std::vector<std::thread> readers;
    for (int i = 0; i < 6; ++i)
      readers.emplace_back([&] {
        for (int j = 0; j < 20; ++j) {
          try {
            auto lease = reg.Open(ByKey(1));
            ++opened;
            lease->Unpin();
            lease->Settle(true);
          } catch (const datadist::Error &e) {
            EXPECT_EQ(e.code(), LLM_KV_CACHE_NOT_EXIST);
            ++refused;
          }
        }
      });
    reg.Deallocate(id, false);
    std::vector<int64_t> released;
    for (auto &t : readers) {
      std::vector<int64_t> got = reg.Released();
      released.insert(released.end(), got.begin(), got.end());
      t.join();
    }
    std::vector<int64_t> got = reg.Released();
    released.insert(released.end(), got.begin(), got.end());
    EXPECT_EQ(Consumed(), std::vector<KeyId>{K(1)});
    EXPECT_EQ(released, std::vector<int64_t>{id});
    EXPECT_GE(opened.load(), 1);
    EXPECT_EQ(opened + refused, 120);
  }
}

// Prefix keys and keys on registered memory reserve nothing (Registry.open: `reserve` needs
// an owned entry and a req_id key); neither do writes.
TEST_F(Native, NonConsumingReadsAndWritesReserveNothing) {
  Pool(1, {P(1)});
  User(2, {K(2)});
  Pool(3, {K(3)});
  auto a = reg.Open(ByPrefix(1));
  auto b = reg.Open(ByPrefix(1));
  auto c = reg.Open(ByKey(2));
  auto d = reg.Open(ByKey(2));
  auto e = reg.OpenWrite(ByKey(3));
  auto f = reg.Open(ByKey(3));  // the write reserved nothing
}

// Python: test_key_removed_and_rebound_elsewhere_during_a_read_is_not_consumed.
TEST_F(Native, AKeyRemovedAndReboundDuringAReadIsNotConsumed) {
  Pool(1, {K(1)});
  auto lease = reg.Open(ByKey(1));
  Unbind(K(1));
  Pool(2, {K(1)});
  lease->Settle(true);
  lease.reset();
  EXPECT_TRUE(Consumed().empty());
  EXPECT_EQ(reg.Open(ByKey(1))->entry().id, 2);
}

// Python: Registry.unlease then settle (test_unlease_frees_the_memory_and_settle_decides_the_key).
TEST_F(Native, UnpinEndsTheMemoryLeaseAndSettleDecidesTheKey) {
  Pool(1, {K(1)});
  reg.Deallocate(1, false);
  auto lease = reg.Open(ByKey(1));
  lease->Unpin();
  EXPECT_TRUE(reg.Released().empty());  // the key still holds the cache
  lease->Settle(false);
  lease = reg.Open(ByKey(1));  // not consumed: readable again
  lease->Unpin();
  lease->Settle(true);
  lease->Settle(false);  // only the first verdict counts
  EXPECT_EQ(Consumed(), std::vector<KeyId>{K(1)});
  EXPECT_EQ(reg.Released(), std::vector<int64_t>{1});
}

// Python: Registry.remove_key (test_remove_key_unknown_is_a_no_op).
TEST_F(Native, UnbindKeyOfAPoolCache) {
  Unbind(K(5));
  Pool(1, {K(1), K(2)});
  Unbind(K(2));
  EXPECT_EQ(Refused([&] { reg.Open(ByKey(2)); }).code, LLM_KV_CACHE_NOT_EXIST);
  Pull(reg, ByKey(1, 0, {0}));
  EXPECT_TRUE(Consumed().empty());  // K(2) was unbound, not consumed
}

// ------------------------------------------------------------------------------ lifetimes

// Python: Registry.deallocate (test_deallocate_defers_the_free_while_keys_hold_the_cache,
// test_consuming_the_last_key_of_a_deallocated_cache_frees_it).
TEST_F(Native, DeallocateKeepsTheCacheWhileKeysHoldIt) {
  Pool(1, {K(1), K(2)});
  reg.Deallocate(1, false);
  EXPECT_EQ(Refused([&] { reg.Open(ById(1)); }).code, LLM_KV_CACHE_NOT_EXIST);
  EXPECT_TRUE(reg.Released().empty());
  Pull(reg, ByKey(1));  // keys still work; this consumes K(1)
  EXPECT_TRUE(reg.Released().empty());
  Unbind(K(2));
  EXPECT_EQ(reg.Released(), std::vector<int64_t>{1});
  Unbind(K(2));
  reg.Deallocate(1, false);
  EXPECT_TRUE(reg.Released().empty());  // listed once
}

// Python: test_a_lease_defers_the_free_until_the_transfer_ends, test_deallocate_without_keys_frees_at_once,
// test_deallocate_unknown_or_registered_is_a_no_op, Lease.wanted_back.
TEST_F(Native, ALeaseDefersTheReleaseAndRegisteredCachesAreNotDeallocated) {
  Pool(1, {K(1)});
  auto lease = reg.Open(ByKey(1));
  EXPECT_FALSE(lease->WantedBack());
  reg.Deallocate(1, false);
  Unbind(K(1));
  EXPECT_TRUE(lease->WantedBack());
  EXPECT_TRUE(reg.Released().empty());  // a peer is still reading this memory
  lease.reset();
  EXPECT_EQ(reg.Released(), std::vector<int64_t>{1});
  Pool(2, {});
  reg.Deallocate(2, false);
  EXPECT_EQ(reg.Released(), std::vector<int64_t>{2});
  User(3, {K(3)});
  reg.Deallocate(3, false);
  reg.Deallocate(99, false);
  Pull(reg, ById(3));
  Pull(reg, ByKey(3));
}

// Python: Registry.unregister drops the cache's keys and model id; while it waits for a lease
// new reads by id or key are refused ("is being unregistered", CacheNotFound)
// (test_unregister_waits_for_live_leases, test_forgetting_the_current_blocks_cache_unbinds_its_model_id).
TEST_F(Native, UnregisterDropsKeysAndModelIdAndRefusesReadsWhileItWaits) {
  User(1, {K(1)});
  reg.Add(2, kBlocks, kBlockAddrs, kUserBlocks);
  reg.BindModel(3, 2);
  auto lease = reg.Open(ById(1));
  std::thread remover([&] { reg.Remove(1, false, 10.0); });
  Refusal r;
  for (int i = 0; i < 2000 && r.code != LLM_KV_CACHE_NOT_EXIST; ++i) {
    r = Refused([&] { reg.Open(ByKey(1)); });
    if (r.code != LLM_KV_CACHE_NOT_EXIST) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(r.msg, "cache 1 is being unregistered");
  lease.reset();
  remover.join();
  EXPECT_EQ(Refused([&] { reg.Open(ByKey(1)); }).msg.rfind("no cache bound to req_id=1", 0), 0U);
  reg.Remove(2, false, 1.0);
  Refusal m = Refused([&] { reg.Open(ByModel(3)); });
  EXPECT_EQ(m.code, LLM_KV_CACHE_NOT_EXIST);
  EXPECT_TRUE(m.Says("model_id=3")) << m.msg;
  User(1, {K(1)});  // the key is free to bind again
}

// Python: Registry.clear (test_clear_returns_every_entry_and_forgets_them).
TEST_F(Native, ClearForgetsCachesKeysAndModelIds) {
  User(1, {K(1)});
  Pool(2, {K(2)});
  reg.Deallocate(2, false);
  reg.Add(3, kBlocks, kBlockAddrs, kUserBlocks);
  reg.BindModel(0, 3);
  EXPECT_EQ(reg.Clear(1.0), 0);
  for (const w::Request &q : {ByKey(1), ByKey(2), ById(1), ByModel(0)})
    EXPECT_EQ(Refused([&] { reg.Open(q); }).code, LLM_KV_CACHE_NOT_EXIST);
}

// ------------------------------------------------------------------------------ filing (the Python face)

// The Python face's register / allocate: the registry numbers the cache and binds its keys
// (key i -> slot i) and model id in one call, all or nothing; Describe, Bound and CheckKeys
// answer what the face used to keep a copy of.
TEST_F(Native, FileNumbersTheCacheAndBindsItsKeysAndModelAllOrNothing) {
  const datadist::Geometry geo = datadist::GeometryOf(kGeo);
  const int64_t first = reg.File(geo, kAddrs, kPool, {}, {K(1), K(2)}, {0, 2}, std::nullopt);
  EXPECT_EQ(first, 1);
  EXPECT_TRUE(reg.Bound(K(1)));
  EXPECT_TRUE(reg.Bound(K(2)));
  EXPECT_EQ(reg.Open(ByKey(2))->bases[0], kAddrs[0] + 2 * 256);  // slot 2
  const datadist::Registry::Info info = reg.Describe(first);
  EXPECT_EQ(info.geo.tensor_bytes, 1024U);
  EXPECT_EQ(info.addrs, kAddrs);
  EXPECT_TRUE(info.opts.allocated);
  // a key bound already: nothing is filed, no id is spent, no key of the call is bound
  Refusal r = Refused([&] { reg.File(geo, kAddrs, kPool, {}, {K(3), K(1)}, {0, 1}, 7); });
  EXPECT_EQ(r.code, LLM_PARAM_INVALID);
  EXPECT_TRUE(r.Says("already bound")) << r.msg;
  EXPECT_FALSE(reg.Bound(K(3)));
  EXPECT_EQ(Refused([&] { reg.Open(ByModel(7)); }).code, LLM_KV_CACHE_NOT_EXIST);
  EXPECT_EQ(reg.Ids(), std::vector<int64_t>{1});
  EXPECT_EQ(Refused([&] { reg.CheckKeys({K(4)}, {4}, 4); }).code, LLM_PARAM_INVALID);  // slot out of range
  EXPECT_EQ(Refused([&] { reg.CheckKeys({K(4), K(4)}, {0, 1}, 4); }).code, LLM_PARAM_INVALID);
  reg.CheckKeys({K(4)}, {3}, 4);
  const datadist::Geometry blocks = datadist::GeometryOf(kBlocks);
  const int64_t second = reg.File(blocks, kBlockAddrs, kPoolBlocks, {}, {}, {}, 7);
  EXPECT_EQ(second, 2);
  EXPECT_EQ(reg.Open(ByModel(7))->entry().id, 2);
  // a consumed key is no longer bound; a deallocated cache is no longer described
  Pull(reg, ByKey(1));
  EXPECT_FALSE(reg.Bound(K(1)));
  reg.Deallocate(first, false);
  EXPECT_EQ(Refused([&] { reg.Describe(first); }).code, LLM_KV_CACHE_NOT_EXIST);
  EXPECT_TRUE(reg.Released().empty());  // K(2) still holds it
  reg.UnbindKey(K(2));
  EXPECT_EQ(reg.Released(), std::vector<int64_t>{first});
  EXPECT_EQ(reg.File(geo, kAddrs, kUser, {}, {}, {}, std::nullopt), 3);  // ids are never reused
}

// ------------------------------------------------------------------------------ hooks outside the mutex

/// A hook that blocks until the test lets it go (at most 10 s): a slow NIXL registration or
/// CUDA query. `let_go` says whether the test let it go, rather than the bound.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool entered = false, open = false, let_go = false;
  void Block() {
    std::unique_lock<std::mutex> lock(mu);
    entered = true;
    cv.notify_all();
    let_go = cv.wait_for(lock, std::chrono::seconds(10), [&] { return open; });
  }
  bool AwaitEntered() {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(10), [&] { return entered; });
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu);
    open = true;
    cv.notify_all();
  }
};

// A registration that takes long (NIXL registering the memory, CUDA asked what it is) runs
// outside the registry's mutex: while it runs, a peer's READ of another cache is opened and
// ended, a local transfer holds and lets go, and the cache being filed is already described.
// Before, `added` ran under the mutex and each of these waited for the registration.
TEST_F(Native, ASlowAddedHookStallsNoOpenHoldOrLeaseEnd) {
  Pool(1, {K(1)});
  Gate gate;
  datadist::RegistryHooks hooks;
  hooks.added = [&](const Entry &e) {
    if (e.id == 2) gate.Block();
  };
  reg.SetHooks(hooks);
  std::thread adder([&] { reg.Add(2, kGeo, kAddrs, kPool); });
  ASSERT_TRUE(gate.AwaitEntered());
  reg.Open(ById(1))->Settle(true);
  reg.Hold(1).reset();
  Pull(reg, ByKey(1));  // a consuming read settles under the mutex too
  gate.Open();
  adder.join();
  EXPECT_TRUE(gate.let_go) << "the reads waited for the registration";
  EXPECT_FALSE(reg.Bound(K(1)));
  reg.SetHooks({});
}

// The same for the hooks of removal: revoking NIXL's leases (`going`) and deregistering
// (`gone`) while an unregister runs leave peers' reads of other caches alone.
TEST_F(Native, SlowRemovalHooksStallNoOpen) {
  Pool(1, {});
  User(2, {});
  for (bool on_going : {true, false}) {
    Gate gate;
    datadist::RegistryHooks hooks;
    hooks.going = [&](const Entry *e) {
      if (on_going && e && e->id == 2) gate.Block();
    };
    hooks.gone = [&](const Entry &e) {
      if (!on_going && e.id == 3) gate.Block();
    };
    reg.SetHooks(hooks);
    if (!on_going) reg.Add(3, kGeo, kAddrs, kUser);
    const int64_t id = on_going ? 2 : 3;
    std::thread remover([&] { reg.Remove(id, false, 5.0); });
    ASSERT_TRUE(gate.AwaitEntered());
    reg.Open(ById(1)).reset();
    reg.Hold(1).reset();
    gate.Open();
    remover.join();
    EXPECT_TRUE(gate.let_go) << (on_going ? "going" : "gone") << " stalled a read";
    EXPECT_EQ(Refused([&] { reg.Open(ById(static_cast<uint64_t>(id))); }).code, LLM_KV_CACHE_NOT_EXIST);
  }
  reg.SetHooks({});
}

// Hooks run in the order of the changes: a cache removed while its registration still runs
// is deregistered after it was registered, never before (NIXL would keep the registration).
TEST_F(Native, ACacheRemovedDuringItsRegistrationIsDeregisteredAfterIt) {
  Gate gate;
  std::mutex mu;
  std::vector<std::string> order;
  datadist::RegistryHooks hooks;
  hooks.added = [&](const Entry &) {
    gate.Block();
    std::lock_guard<std::mutex> lock(mu);
    order.push_back("added");
  };
  hooks.gone = [&](const Entry &) {
    std::lock_guard<std::mutex> lock(mu);
    order.push_back("gone");
  };
  reg.SetHooks(hooks);
  std::thread adder([&] { reg.Add(1, kGeo, kAddrs, kUser); });
  ASSERT_TRUE(gate.AwaitEntered());
  std::thread remover([&] { reg.Remove(1, false, 5.0); });
  // the removal may run up to its hook; it cannot pass the registration
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  gate.Open();
  adder.join();
  remover.join();
  EXPECT_EQ(order, (std::vector<std::string>{"added", "gone"}));
  reg.SetHooks({});
}

// ------------------------------------------------------------------------------ 2. private caches

// Python: _check_servable (test_open_refuses_a_cache_that_is_not_remote_accessible): by id,
// key or model id, read, write or lease: InvalidArgument "cache N is not remote accessible";
// an address write into it gets the one ADDRESS_REFUSED answer (Registry.open_addresses).
TEST_F(Native, APrivateCacheIsRefusedToPeers) {
  reg.Add(1, kGeo, kAddrs, kPrivate);
  Bind(1, {K(1)}, {0});
  reg.Add(2, kBlocks, kBlockAddrs, CacheOptions{false, false, true});
  reg.BindModel(5, 2);
  for (const w::Request &q : {ById(1), ByKey(1), ByModel(5)}) {
    for (bool write : {false, true}) {
      Refusal r = Refused([&] { write ? reg.OpenWrite(q) : reg.Open(q); });
      EXPECT_EQ(r.code, LLM_PARAM_INVALID);
      EXPECT_TRUE(r.Says("is not remote accessible")) << r.msg;
    }
  }
  Refusal l = Refused([&] { reg.LeaseCache(LeaseBy(w::kCacheId, 1, 0)); });
  EXPECT_EQ(l.code, LLM_PARAM_INVALID);
  EXPECT_EQ(l.msg, "cache 1 is not remote accessible");
  EXPECT_EQ(Refused([&] { reg.LeaseCache(LeaseBy(w::kBlocksKey, 0, 5)); }).code, LLM_PARAM_INVALID);
  Refusal a = Refused([&] { reg.OpenWrite(Req(w::kAddress, 0, 0, 0, {0}, kAddrs[1] + 8, 8)); });
  EXPECT_EQ(a.code, LLM_PARAM_INVALID);
  EXPECT_EQ(a.msg,
            "the addresses do not lie inside one tensor of a remote-accessible registered cache (spans of >= 1 byte)");
  // nothing was leased: an unregister does not wait
  reg.Remove(1, false, 0.0);
}

// ------------------------------------------------------------------------------ 3. write switch

// Python: Engine._check_writable (before Registry.open, so even an unknown cache gets it) and
// Engine.lease_cache for LEASE_WRITE: InvalidArgument; raw-address writes and reads stay.
TEST_F(Native, WithoutRemoteWritesWritesByKeyOrIdAreRefused) {
  Pool(1, {K(1)});
  reg.Add(2, kBlocks, kBlockAddrs, kUserBlocks);
  reg.BindModel(0, 2);
  reg.SetRemoteWrites(false);
  const std::string why =
      "this owner runs without enable_remote_cache_accessible: writes by key or cache id are refused";
  for (const w::Request &q : {ById(1), ByKey(1), ByModel(0), ById(9)}) {
    Refusal r = Refused([&] { reg.OpenWrite(q); });
    EXPECT_EQ(r.code, LLM_PARAM_INVALID);
    EXPECT_EQ(r.msg, why);
  }
  Refusal l = Refused([&] { reg.LeaseCache(LeaseBy(w::kCacheId, 1, 0, w::kLeaseWrite)); });
  EXPECT_EQ(l.code, LLM_PARAM_INVALID);
  EXPECT_EQ(l.msg, why);
  reg.LeaseCache(LeaseBy(w::kCacheId, 1, 0));  // a read lease
  reg.OpenWrite(Req(w::kAddress, 0, 0, 0, {0}, kAddrs[1] + 8, 8)).reset();
  Pull(reg, ByKey(1));
  reg.SetRemoteWrites(true);
  reg.OpenWrite(ById(1)).reset();
}

// ------------------------------------------------------------------------------ 5. model ids

// Python: Registry._named resolves a BlocksCacheKey by registry._blocks, last writer wins,
// and forgetting an older cache keeps the newer binding (test_blocks_cache_key_is_last_writer_wins).
TEST_F(Native, ModelIdsResolveThroughTheMapLastWriterWins) {
  reg.Add(1, kBlocks, kBlockAddrs, kUserBlocks);
  reg.BindModel(7, 1);
  reg.Add(2, kBlocks, kBlockAddrs, kUserBlocks);
  reg.BindModel(7, 2);
  reg.Add(3, kBlocks, kBlockAddrs, kUserBlocks);
  reg.BindModel(8, 3);
  EXPECT_EQ(reg.Open(ByModel(7))->entry().id, 2);
  EXPECT_EQ(reg.Open(ByModel(8))->entry().id, 3);
  reg.Remove(1, false, 1.0);
  EXPECT_EQ(reg.Open(ByModel(7))->entry().id, 2);
  // the model id is not the cache id in this mode (Python has no such rule)
  Refusal r = Refused([&] { reg.Open(ByModel(1)); });
  EXPECT_EQ(r.code, LLM_KV_CACHE_NOT_EXIST);
  EXPECT_EQ(r.msg,
            "no blocks cache registered for model_id=1 (the owner must register_blocks_cache with "
            "BlocksCacheKey(its cluster id, 1))");
  reg.UnbindModel(8);
  EXPECT_EQ(Refused([&] { reg.Open(ByModel(8)); }).code, LLM_KV_CACHE_NOT_EXIST);
  EXPECT_EQ(Refused([&] { reg.BindModel(9, 42); }).code, LLM_KV_CACHE_NOT_EXIST);
}

// Python: Registry.add with a model id bound before revokes the old cache's whole-cache leases
// ("leases through the model id named the old cache").
TEST_F(Native, RebindingAModelIdRevokesTheOldCachesLeases) {
  reg.Add(1, kBlocks, kBlockAddrs, kUserBlocks);
  reg.BindModel(7, 1);
  w::CacheLease l = reg.LeaseCache(LeaseBy(w::kBlocksKey, 0, 7));
  EXPECT_EQ(l.cache_id, 1U);
  EXPECT_TRUE(l.is_blocks);
  std::string why;
  auto view = datadist::lease::FenceView::Open(getpid(), l.fence_fd, l.fence_ino, why);
  ASSERT_TRUE(view) << why;
  EXPECT_FALSE(view->Revoked());
  reg.Add(2, kBlocks, kBlockAddrs, kUserBlocks);
  reg.BindModel(7, 2);
  EXPECT_TRUE(view->Revoked());
  EXPECT_EQ(reg.LeaseCache(LeaseBy(w::kBlocksKey, 0, 7)).cache_id, 2U);
}

// Python: test_deallocate_of_a_blocks_cache_drops_its_keys (deallocate(drop_keys=True)).
TEST_F(Native, DeallocatingABlocksCacheDropsItsModelId) {
  reg.Add(1, kBlocks, kBlockAddrs, kPoolBlocks);
  reg.BindModel(4, 1);
  w::CacheLease l = reg.LeaseCache(LeaseBy(w::kBlocksKey, 0, 4));
  std::string why;
  auto view = datadist::lease::FenceView::Open(getpid(), l.fence_fd, l.fence_ino, why);
  ASSERT_TRUE(view) << why;
  reg.Deallocate(1, true);
  EXPECT_TRUE(view->Revoked());  // leases by id or model id end with the id
  EXPECT_EQ(reg.Released(), std::vector<int64_t>{1});
  EXPECT_EQ(Refused([&] { reg.Open(ByModel(4)); }).code, LLM_KV_CACHE_NOT_EXIST);
}

// The C++ API's rule, unchanged: without the map, a BlocksCacheKey's model id is the cache id.
TEST(RegistryCppApi, AModelIdIsTheCacheIdWithoutTheMap) {
  Registry reg;
  HostCache c(2, {8, 64});
  const int64_t id = reg.Add(c.desc, c.addrs, {});
  EXPECT_EQ(reg.Open(ByModel(static_cast<uint64_t>(id)))->entry().id, id);
  EXPECT_EQ(reg.LeaseCache(LeaseBy(w::kBlocksKey, 0, static_cast<uint64_t>(id))).cache_id, static_cast<uint64_t>(id));
  EXPECT_FALSE(reg.LeaseCache(LeaseBy(w::kBlocksKey, 0, static_cast<uint64_t>(id))).is_blocks);
  EXPECT_EQ(Refused([&] { reg.Open(ByModel(5)); }).msg, "cache 5 does not exist");
  EXPECT_EQ(Refused([&] { reg.Open(ByKey(1)); }).code, LLM_KV_CACHE_NOT_EXIST);  // no keys bound
}

// Python: finalize leaves memory a copy still reads mapped (leaked) rather than freeing it
// (docs/reliability.md). Clear counts the cache, and the memory the registry holds for it
// (AllocateCache's) goes only once the copy ended. Before, Clear dropped the entry at its
// deadline and with it the memory.
TEST(RegistryCppApi, ClearKeepsTheMemoryOfACacheStillBeingCopied) {
  Registry reg;
  HostCache c(2, {8, 64});
  auto freed = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<void> region(static_cast<void *>(new int(0)), [freed](void *p) {
    delete static_cast<int *>(p);
    *freed = true;
  });
  const int64_t id = reg.Add(c.desc, c.addrs, {}, region);
  region.reset();
  w::CacheLease l = reg.LeaseCache(LeaseBy(w::kCacheId, static_cast<uint64_t>(id), 0));
  std::string why;
  auto view = datadist::lease::FenceView::Open(getpid(), l.fence_fd, l.fence_ino, why);
  ASSERT_TRUE(view && view->Enter()) << why;
  EXPECT_EQ(reg.Clear(0.01), 1);
  EXPECT_FALSE(freed->load()) << "freed under a copy in flight";
  view->Leave();
  EXPECT_EQ(reg.Clear(0.0), 0);
  EXPECT_TRUE(freed->load());
}

// ------------------------------------------------------------------------------ 6. leases

// Python: Registry.lease_cache resolves and refuses as open does (_named): unknown id or model
// id, and a cache being unregistered, are CacheNotFound.
TEST_F(Native, LeaseCacheResolvesAndRefusesAsOpen) {
  reg.Add(3, kGeo, kAddrs, kUser);
  EXPECT_EQ(reg.LeaseCache(LeaseBy(w::kCacheId, 3, 99)).cache_id, 3U);
  EXPECT_FALSE(reg.LeaseCache(LeaseBy(w::kCacheId, 3, 0)).is_blocks);
  EXPECT_EQ(Refused([&] { reg.LeaseCache(LeaseBy(w::kCacheId, 4, 0)); }).msg, "cache 4 does not exist");
  EXPECT_EQ(Refused([&] { reg.LeaseCache(LeaseBy(w::kBlocksKey, 0, 3)); }).code, LLM_KV_CACHE_NOT_EXIST);
  Pool(4, {K(1)});
  reg.Deallocate(4, false);
  EXPECT_EQ(Refused([&] { reg.LeaseCache(LeaseBy(w::kCacheId, 4, 0)); }).code, LLM_KV_CACHE_NOT_EXIST);
}

// ------------------------------------------------------------------------------ 7. open() checks

/// A request with these spans (Python's test `read` / `reg.open` with arrays).
w::Request Spans(uint8_t kind, uint64_t a, uint64_t b, std::vector<uint32_t> tensors, std::vector<uint64_t> offsets,
                 std::vector<uint64_t> lengths, uint64_t unit_bytes = 0) {
  w::Request r = Req(kind, a, b, 0, std::move(tensors), 0, 0, unit_bytes);
  r.offsets = std::move(offsets);
  r.lengths = std::move(lengths);
  return r;
}

// The server opens a peer's READ and WRITE without expanding its spans (a request of 4M
// expanded spans costs its frame's size, not 64 MiB): Span and Expand give what iov would hold.
TEST_F(Native, AnUnexpandedLeaseGivesTheSameSpansAPartAtATime) {
  User(1);
  const w::Request req = Spans(w::kCacheId, 1, 3, {1, 2}, {16, 0, 100}, {240, 8, 4});
  auto full = reg.Open(req);
  auto lazy = reg.Open(req, false);
  EXPECT_TRUE(lazy->iov.empty());
  ASSERT_EQ(lazy->spans(), full->iov.size());
  EXPECT_EQ(lazy->nbytes, full->nbytes);
  EXPECT_EQ(lazy->bases, full->bases);
  std::vector<iovec> parts;
  lazy->Expand(0, 4, parts);
  lazy->Expand(4, 100, parts);  // clipped to the spans there are
  ASSERT_EQ(parts.size(), full->iov.size());
  for (size_t k = 0; k < parts.size(); ++k) {
    EXPECT_EQ(parts[k].iov_base, full->iov[k].iov_base) << k;
    EXPECT_EQ(parts[k].iov_len, full->iov[k].iov_len) << k;
    EXPECT_EQ(lazy->Span(k).iov_base, full->iov[k].iov_base) << k;
  }
}

// Python: Registry.add (test_address_count_must_match_num_tensors).
TEST_F(Native, TheAddressCountMustMatchTheTensors) {
  Refusal r = Refused([&] { reg.Add(1, kGeo, {kAddrs[0], kAddrs[1], kAddrs[2]}, kUser); });
  EXPECT_EQ(r.code, LLM_PARAM_INVALID);
  EXPECT_TRUE(r.Says("3 addresses given for 4 tensors")) << r.msg;
  EXPECT_EQ(Refused([&] { reg.Open(ById(1)); }).code, LLM_KV_CACHE_NOT_EXIST);  // nothing filed
}

// Python: test_open_by_cache_id_and_batch_index: tensors 1 and 2 of slot 3, 240 bytes at 16.
TEST_F(Native, OpenByCacheIdAndBatchIndex) {
  User(1);
  auto lease = reg.Open(Spans(w::kCacheId, 1, 3, {1, 2}, {16}, {240}));
  EXPECT_EQ(lease->bases, (std::vector<uint64_t>{kAddrs[1] + 768, kAddrs[2] + 768}));
  ASSERT_EQ(lease->iov.size(), 2U);
  EXPECT_EQ(lease->iov[1].iov_base, reinterpret_cast<void *>(kAddrs[2] + 768 + 16));
  EXPECT_EQ(lease->iov[1].iov_len, 240U);
  EXPECT_EQ(lease->nbytes, 480U);
  const Entry &e = lease->entry();
  EXPECT_EQ(e.leases, 1);
  lease.reset();
  EXPECT_EQ(e.leases, 0);
}

// Python: test_a_slot_read_may_run_into_the_following_slots_but_not_past_the_tensor.
TEST_F(Native, ASlotReadMayRunIntoTheFollowingSlotsButNotPastTheTensor) {
  User(1);
  Pull(reg, Spans(w::kCacheId, 1, 1, kAll, {0}, {3 * 256}));
  for (const w::Request &q :
       {Spans(w::kCacheId, 1, 1, kAll, {0}, {3 * 256 + 1}), Spans(w::kCacheId, 1, 3, kAll, {200}, {57})}) {
    Refusal r = Refused([&] { reg.Open(q); });
    EXPECT_EQ(r.code, LLM_PARAM_INVALID);
    EXPECT_TRUE(r.Says("outside")) << r.msg;
  }
}

// Python: test_open_refuses_what_does_not_fit, test_open_refuses_a_batch_index_out_of_range,
// test_a_tensor_named_twice_is_refused_for_reads_and_writes; a refused request holds nothing.
TEST_F(Native, OpenRefusesWhatDoesNotFitAndHoldsNothing) {
  User(1);
  struct Case {
    w::Request q;
    const char *says;
  };
  const std::vector<Case> cases = {
      {Spans(w::kCacheId, 1, 0, {4}, {0}, {8}), "tensor 4 out of range"},
      {Spans(w::kCacheId, 1, 0, {0, 0xFFFFFFFFU}, {0}, {8}), "out of range"},
      {Spans(w::kCacheId, 1, 0, {0}, {kMax - 7}, {16}), "outside"},
      {Spans(w::kCacheId, 1, 0, {0}, {0}, {kMax}), "outside"},
      {ById(1, 4), "batch index 4 out of range: cache 1 has 4"},
      {ById(1, 1ULL << 32), "batch index"},
      {ById(1, kMax), "batch index"},
      {Spans(w::kCacheId, 1, 0, {1, 2, 1}, {0}, {8}), "named twice"},
  };
  for (const Case &c : cases) {
    for (bool write : {false, true}) {
      Refusal r = Refused([&] { write ? reg.OpenWrite(c.q) : reg.Open(c.q); });
      EXPECT_EQ(r.code, LLM_PARAM_INVALID) << c.says;
      EXPECT_TRUE(r.Says(c.says)) << r.msg;
    }
  }
  reg.Remove(1, false, 0.0);  // nothing was leased: it does not wait
}

// Python: test_open_with_no_tensors_or_spans.
TEST_F(Native, OpenWithNoTensorsOrSpans) {
  User(1);
  auto lease = reg.Open(Spans(w::kCacheId, 1, 0, {}, {}, {}));
  EXPECT_EQ(lease->nbytes, 0U);
  EXPECT_TRUE(lease->iov.empty());
}

// Python: test_open_refuses_requests_naming_too_many_spans (MAX_REQUEST_SPANS, before any
// per-span work: 4096 tensors x 1025 spans, all tensor 0).
TEST_F(Native, OpenRefusesRequestsNamingTooManySpans) {
  User(1);
  const uint64_t spans = kMaxRequestSpansForTest / 4096 + 1;
  w::Request q = Spans(w::kCacheId, 1, 0, std::vector<uint32_t>(4096, 0), std::vector<uint64_t>(spans, 0),
                       std::vector<uint64_t>(spans, 1));
  Refusal r = Refused([&] { reg.Open(q); });
  EXPECT_EQ(r.code, LLM_PARAM_INVALID);
  EXPECT_TRUE(r.Says("too many spans")) << r.msg;
  q.tensors.assign(4096 / 4, 0);  // within the cap: the next rule speaks
  EXPECT_TRUE(Refused([&] { reg.Open(q); }).Says("named twice"));
  reg.Remove(1, false, 0.0);
}

// Python: test_open_checks_the_requesters_layout_tag: 0 on either side passes; another dtype
// or (blocks) another block shape is refused.
TEST_F(Native, OpenChecksTheRequestersLayoutTag) {
  const uint64_t f16 = w::LayoutTag(DT_FLOAT16, {64}), f32 = w::LayoutTag(DT_FLOAT, {64});
  datadist::Geometry g;
  g.num_tensors = 2;
  g.tensor_bytes = 8 * 64;
  g.units = 8;
  g.unit_bytes = 64;
  g.layout = f16;
  reg.AddAs(1, g, kBlockAddrs, kUserBlocks);
  reg.BindModel(0, 1);
  auto with = [](uint64_t layout) {
    w::Request q = Req(w::kBlocksKey, 0, 0, 0, {0, 1}, 0, 64, 64);
    q.layout = layout;
    return q;
  };
  Pull(reg, with(f16));
  Pull(reg, with(0));
  Refusal dtype = Refused([&] { reg.Open(with(f32)); });
  EXPECT_EQ(dtype.code, LLM_PARAM_INVALID);
  EXPECT_TRUE(dtype.Says("holds DT_FLOAT16, the requester's cache DT_FLOAT:")) << dtype.msg;
  Refusal shape = Refused([&] { reg.Open(with(w::LayoutTag(DT_FLOAT16, {32, 2}))); });
  EXPECT_EQ(shape.code, LLM_PARAM_INVALID);
  EXPECT_TRUE(shape.Says("block shape")) << shape.msg;
  // by slot (cache id) the shapes may differ (sizes and offsets say what moves); the dtype may not
  w::Request slot = Req(w::kCacheId, 1, 0, 0, {0, 1}, 0, 64);
  slot.layout = w::LayoutTag(DT_FLOAT16, {32, 2});
  Pull(reg, slot);
  slot.layout = f32;
  EXPECT_TRUE(Refused([&] { reg.Open(slot); }).Says("holds DT_FLOAT16, the requester's cache DT_FLOAT:"));
  reg.Remove(1, false, 0.0);
}

// Python: test_blocks_key_offsets_are_absolute_within_the_tensor,
// test_blocks_key_refuses_a_block_size_mismatch_and_unit_bytes_zero_means_any,
// test_blocks_key_span_past_the_tensor_is_refused.
TEST_F(Native, BlocksKeyOffsetsAreAbsoluteAndTheBlockSizeMustMatch) {
  reg.Add(1, kBlocks, kBlockAddrs, kUserBlocks);
  reg.BindModel(0, 1);
  auto lease = reg.Open(Req(w::kBlocksKey, 0, 0, 0, {0, 1}, 7 * 64, 64, 64));
  EXPECT_EQ(lease->bases, kBlockAddrs);
  ASSERT_EQ(lease->iov.size(), 2U);
  EXPECT_EQ(lease->iov[0].iov_base, reinterpret_cast<void *>(kAddrs[0] + 448));
  EXPECT_EQ(lease->iov[1].iov_base, reinterpret_cast<void *>(kAddrs[1] + 448));
  lease.reset();
  Refusal size = Refused([&] { reg.Open(Req(w::kBlocksKey, 0, 0, 0, {0, 1}, 0, 32, 32)); });
  EXPECT_EQ(size.code, LLM_PARAM_INVALID);
  EXPECT_TRUE(size.Says("block size mismatch")) << size.msg;
  Pull(reg, Req(w::kBlocksKey, 0, 0, 0, {0, 1}, 0, 32, 0));  // unit_bytes 0: any
  Refusal past = Refused([&] { reg.Open(Req(w::kBlocksKey, 0, 0, 0, {0, 1}, 8 * 64, 64, 64)); });
  EXPECT_EQ(past.code, LLM_PARAM_INVALID);
  EXPECT_TRUE(past.Says("src block 8 out of range: cache 1 has 8 blocks")) << past.msg;
}

// ------------------------------------------------------------------------------ 8. address writes

// Python: Registry.open_addresses (TestOpenAddresses): a write by raw addresses must lie in
// one tensor of one remote-accessible cache; every refusal that depends on where it points is
// one answer (no address oracle, issue 21 item 2).
const std::string kAddressRefused =
    "the addresses do not lie inside one tensor of a remote-accessible registered cache (spans of >= 1 byte)";
w::Request AddrWrite(std::vector<uint64_t> offsets, std::vector<uint64_t> lengths,
                     std::vector<uint32_t> tensors = {0}) {
  return Spans(w::kAddress, 0, 0, std::move(tensors), std::move(offsets), std::move(lengths));
}

TEST_F(Native, AnAddressWriteLeasesTheCacheHoldingItsSpans) {
  User(1);
  auto lease = reg.OpenWrite(AddrWrite({kAddrs[1] + 8, kAddrs[1] + 1000}, {16, 24}));
  EXPECT_EQ(lease->entry().id, 1);
  EXPECT_EQ(lease->entry().leases, 1);
  ASSERT_EQ(lease->iov.size(), 2U);
  EXPECT_EQ(lease->iov[0].iov_base, reinterpret_cast<void *>(kAddrs[1] + 8));
  EXPECT_EQ(lease->iov[1].iov_base, reinterpret_cast<void *>(kAddrs[1] + 1000));
  EXPECT_EQ(lease->iov[1].iov_len, 24U);
  EXPECT_EQ(lease->nbytes, 40U);
  const Entry &e = lease->entry();
  lease.reset();
  EXPECT_EQ(e.leases, 0);
}

TEST_F(Native, AnAddressWriteLeavingItsTensorIsRefused) {
  User(1);
  for (const w::Request &q : {AddrWrite({kAddrs[0] + 1000}, {25}),        // past the 1024-byte tensor
                              AddrWrite({kAddrs[0], kAddrs[1]}, {8, 8}),  // two tensors
                              AddrWrite({kAddrs[0] + 8}, {kMax - 7})}) {  // a length that wraps
    Refusal r = Refused([&] { reg.OpenWrite(q); });
    EXPECT_EQ(r.code, LLM_PARAM_INVALID);
    EXPECT_EQ(r.msg, kAddressRefused);
  }
  reg.Remove(1, false, 0.0);
}

TEST_F(Native, UnknownPrivateAndEmptyAddressSpansGetOneAnswer) {
  reg.Add(1, kGeo, kAddrs, kPrivate);
  const std::vector<uint64_t> ours = {kAddrs[0] + 0x100000};  // a second, servable cache
  reg.Add(2, Desc(1, {4, 256}), ours, kUser);
  std::set<std::pair<int, std::string>> answers;
  for (const w::Request &q : {AddrWrite({0x5000}, {8}), AddrWrite({kAddrs[0]}, {8}), AddrWrite({kAddrs[0] + 1000}, {8}),
                              AddrWrite({ours[0]}, {0}), AddrWrite({0x5000}, {0}), AddrWrite({ours[0] + 10}, {0})}) {
    Refusal r = Refused([&] { reg.OpenWrite(q); });
    answers.insert({static_cast<int>(r.code), r.msg});
  }
  ASSERT_EQ(answers.size(), 1U);
  EXPECT_EQ(answers.begin()->first, static_cast<int>(LLM_PARAM_INVALID));
  EXPECT_EQ(answers.begin()->second, kAddressRefused);
  reg.OpenWrite(AddrWrite({ours[0]}, {8})).reset();  // the servable one is written
  // an empty span by cache id is refused too
  Refusal empty = Refused([&] { reg.OpenWrite(Spans(w::kCacheId, 2, 0, {0}, {0}, {0})); });
  EXPECT_EQ(empty.code, LLM_PARAM_INVALID);
  EXPECT_TRUE(empty.Says("empty")) << empty.msg;
  reg.Remove(1, false, 0.0);
  reg.Remove(2, false, 0.0);
}

TEST_F(Native, MalformedAddressWritesAreRefused) {
  User(1);
  for (const w::Request &q : {AddrWrite({kAddrs[0]}, {8}, {1}), AddrWrite({kAddrs[0]}, {8}, {0, 0}), AddrWrite({}, {})})
    EXPECT_EQ(Refused([&] { reg.OpenWrite(q); }).code, LLM_PARAM_INVALID);
  reg.Remove(1, false, 0.0);
}

// ------------------------------------------------------------------------------ 9. unregister

// Python: test_unregister_times_out_when_a_lease_stays,
// test_unregister_that_outwaits_its_bound_keeps_the_cache_registered,
// test_unregister_unknown_is_a_no_op.
TEST_F(Native, AnUnregisterThatOutwaitsItsBoundKeepsTheCache) {
  reg.Remove(12, false, 0.0);
  User(1, {K(1)});
  auto lease = reg.Open(ById(1));
  Refusal r = Refused([&] { reg.Remove(1, false, 0.05); });
  EXPECT_EQ(r.code, llm_datadist::LLM_TIMEOUT);
  EXPECT_TRUE(r.Says("still being transferred; it stays registered")) << r.msg;
  // still registered, not closing: new transfers start again
  reg.Open(ByKey(1)).reset();
  lease.reset();
  reg.Remove(1, false, 0.05);
  EXPECT_EQ(Refused([&] { reg.Open(ById(1)); }).code, LLM_KV_CACHE_NOT_EXIST);
}

// ------------------------------------------------------------------------------ 10. lease fences

// Python: tests/core/test_fence.py, the registry's part; a reader's view is opened through
// /proc/self/fd as another process would (its own open file description).
std::unique_ptr<datadist::lease::FenceView> ViewOf(const w::CacheLease &l) {
  std::string why;
  auto v = datadist::lease::FenceView::Open(getpid(), l.fence_fd, l.fence_ino, why);
  EXPECT_TRUE(v) << why;
  return v;
}

// test_unregister_waits_for_a_leased_copy_and_revokes
TEST_F(Native, UnregisterWaitsForALeasedCopyAndRevokes) {
  reg.Add(1, kBlocks, kBlockAddrs, kUserBlocks);
  reg.BindModel(5, 1);
  auto view = ViewOf(reg.LeaseCache(LeaseBy(w::kBlocksKey, 0, 5)));
  ASSERT_TRUE(view && view->Enter());
  EXPECT_EQ(Refused([&] { reg.Remove(1, false, 0.05); }).code, llm_datadist::LLM_TIMEOUT);
  reg.Open(ByModel(5)).reset();  // the cache stays
  std::atomic<bool> done{false};
  std::thread remover([&] {
    reg.Remove(1, false, 5.0);
    done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(done.load());
  view->Leave();
  remover.join();
  EXPECT_FALSE(view->Enter());  // revoked
  EXPECT_EQ(Refused([&] { reg.LeaseCache(LeaseBy(w::kBlocksKey, 0, 5)); }).code, LLM_KV_CACHE_NOT_EXIST);
}

// test_pool_memory_goes_back_only_once_the_copy_ended
TEST_F(Native, PoolMemoryGoesBackOnlyOnceTheLeasedCopyEnded) {
  reg.Add(1, kBlocks, kBlockAddrs, kPoolBlocks);
  reg.BindModel(6, 1);
  auto view = ViewOf(reg.LeaseCache(LeaseBy(w::kCacheId, 1, 0)));
  ASSERT_TRUE(view && view->Enter());
  reg.Deallocate(1, true);
  EXPECT_TRUE(reg.Released().empty());  // a leased copy is still reading it
  view->Leave();
  EXPECT_EQ(reg.Released(), std::vector<int64_t>{1});
}

// Python: test_pool_memory_goes_back_only_once_the_copy_ended's wait_unleased: finalize
// counts a deallocated cache whose leased copy is in flight as still leased.
TEST_F(Native, ClearCountsALeasedCopyInFlight) {
  reg.Add(1, kBlocks, kBlockAddrs, kPoolBlocks);
  auto view = ViewOf(reg.LeaseCache(LeaseBy(w::kCacheId, 1, 0)));
  ASSERT_TRUE(view && view->Enter());
  reg.Deallocate(1, true);
  std::thread leaver([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    view->Leave();
  });
  EXPECT_EQ(reg.Clear(0.01), 1);
  leaver.join();
}

// test_binding_a_model_id_anew_revokes_the_old_lease, test_a_revoked_cache_is_leased_with_a_new_fence
TEST_F(Native, ARevokedLeaseIsReplacedByANewFence) {
  reg.Add(1, kBlocks, kBlockAddrs, kUserBlocks);
  reg.BindModel(7, 1);
  w::CacheLease first = reg.LeaseCache(LeaseBy(w::kBlocksKey, 0, 7));
  EXPECT_EQ(reg.LeaseCache(LeaseBy(w::kCacheId, 1, 0)).fence_ino, first.fence_ino);  // live: the same
  auto view = ViewOf(first);
  ASSERT_TRUE(view && view->Enter());
  view->Leave();
  reg.Add(2, kBlocks, kBlockAddrs, kUserBlocks);
  reg.BindModel(7, 2);
  EXPECT_FALSE(view->Enter());  // the model id names another cache now
  w::CacheLease other = reg.LeaseCache(LeaseBy(w::kBlocksKey, 0, 7));
  EXPECT_EQ(other.cache_id, 2U);
  EXPECT_NE(other.fence_ino, first.fence_ino);
  w::CacheLease again = reg.LeaseCache(LeaseBy(w::kCacheId, 1, 0));  // cache 1's fence was revoked
  EXPECT_NE(again.fence_ino, first.fence_ino);
  auto fresh = ViewOf(again);
  ASSERT_TRUE(fresh);
  EXPECT_FALSE(fresh->Revoked());
  EXPECT_TRUE(fresh->Enter());
  fresh->Leave();
}

// test_cache_keys_are_never_leased
TEST_F(Native, CacheKeysAreNeverLeased) {
  Pool(1, {K(1)});
  Refusal r = Refused([&] { reg.LeaseCache(LeaseBy(w::kCacheKey, 1, 0)); });
  EXPECT_EQ(r.code, LLM_PARAM_INVALID);
  EXPECT_EQ(r.msg, "a cache lease names a cache by id or BlocksCacheKey");
}

// test_a_copy_under_a_replaced_fence_is_waited_for_too: a cache leased by model id, the model
// id bound to another cache (the fence revoked, not drained: the old cache is still valid),
// then leased again by id (a new fence): its unregister and the release of its memory still
// wait for the copy under the first fence. Before, the replaced fence was dropped and only
// the new one drained: the memory went while the first copy read it.
TEST_F(Native, ACopyUnderAReplacedFenceIsWaitedForToo) {
  reg.Add(1, kBlocks, kBlockAddrs, kPoolBlocks);
  reg.BindModel(9, 1);
  auto first = ViewOf(reg.LeaseCache(LeaseBy(w::kBlocksKey, 0, 9)));
  ASSERT_TRUE(first && first->Enter());  // a long copy under the first fence
  reg.Add(2, kBlocks, kBlockAddrs, kUserBlocks);
  reg.BindModel(9, 2);
  w::CacheLease second = reg.LeaseCache(LeaseBy(w::kCacheId, 1, 0));
  auto view2 = ViewOf(second);
  ASSERT_TRUE(view2 && !view2->Revoked());
  EXPECT_EQ(Refused([&] { reg.Remove(1, false, 0.05); }).code, llm_datadist::LLM_TIMEOUT);
  reg.Deallocate(1, true);
  EXPECT_TRUE(reg.Released().empty());
  first->Leave();
  EXPECT_EQ(reg.Released(), std::vector<int64_t>{1});
}

// ------------------------------------------------------------------------------ 11. fence files

// Python: tests/core/test_fence.py, the file's part (a copy in flight keeping the fence from
// draining: local_test.cc Fence.SharedLocksAreCountedPerDescriptionAndDrainWaitsForAll).

// test_a_reader_never_waits_for_the_owner
TEST(LeaseFence, AReaderNeverWaitsForTheOwner) {
  datadist::lease::Fence fence;
  std::string why;
  auto view = datadist::lease::FenceView::Open(getpid(), fence.fd(), fence.ino(), why);
  ASSERT_TRUE(view) << why;
  ASSERT_EQ(flock(fence.fd(), LOCK_EX), 0);  // the owner draining right now
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(view->Enter());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(500));
  ASSERT_EQ(flock(fence.fd(), LOCK_UN), 0);
  EXPECT_TRUE(view->Enter());  // not revoked: the next copy goes ahead
  view->Leave();
}

// test_the_flag_outlives_the_owners_descriptor
TEST(LeaseFence, TheFlagOutlivesTheOwnersDescriptor) {
  auto fence = std::make_unique<datadist::lease::Fence>();
  std::string why;
  auto view = datadist::lease::FenceView::Open(getpid(), fence->fd(), fence->ino(), why);
  ASSERT_TRUE(view) << why;
  EXPECT_FALSE(view->Revoked());
  fence.reset();  // revokes and closes: the reader's file keeps the flag
  EXPECT_TRUE(view->Revoked());
  EXPECT_FALSE(view->Enter());
}

// test_a_view_checks_what_it_opens
TEST(LeaseFence, AViewChecksWhatItOpens) {
  datadist::lease::Fence fence;
  std::string why;
  EXPECT_FALSE(datadist::lease::FenceView::Open(getpid(), fence.fd(), fence.ino() + 1, why));
  EXPECT_NE(why.find("not the fence"), std::string::npos) << why;
  int p[2];
  ASSERT_EQ(pipe(p), 0);
  struct stat st {};
  ASSERT_EQ(fstat(p[0], &st), 0);
  EXPECT_FALSE(datadist::lease::FenceView::Open(getpid(), p[0], st.st_ino, why));
  close(p[0]);
  close(p[1]);
  const int plain = static_cast<int>(syscall(SYS_memfd_create, "plain", MFD_CLOEXEC));
  ASSERT_GE(plain, 0);
  ASSERT_EQ(ftruncate(plain, 4096), 0);
  ASSERT_EQ(fstat(plain, &st), 0);
  why.clear();
  EXPECT_FALSE(datadist::lease::FenceView::Open(getpid(), plain, st.st_ino, why));
  EXPECT_NE(why.find("sealed"), std::string::npos) << why;
  close(plain);
}

// ------------------------------------------------------------------------------ the server

class Served : public Native {
 protected:
  void SetUp() override {
    Native::SetUp();
    ident.cluster_id = 9;
    server = std::make_unique<datadist::Server>(&reg, &ident);
    server->Start("127.0.0.1", 0, 16, 16);
    conn = Hello(datadist::Conn::Connect("127.0.0.1", server->port(), datadist::After(2)));
  }
  void TearDown() override {
    conn.reset();
    server->Stop();
  }
  static std::unique_ptr<datadist::Conn> Hello(std::unique_ptr<datadist::Conn> c) {
    w::Hello h;
    h.cluster_id = 10;
    h.role = 2;
    h.pid = static_cast<uint32_t>(getpid());
    c->SendFrame(w::EncodeHello(w::kHello, h, 1), datadist::After(2));
    std::vector<uint8_t> p;
    EXPECT_EQ(c->RecvFrame(p, datadist::After(2)).type, w::kWelcome);
    return c;
  }
  /// A READ on `c`: the error code, or 0 with the bytes in `got`; then a PING, so that the
  /// server has settled the read when this returns (it serves a connection in order).
  static int64_t Read(datadist::Conn &c, const w::Request &q, std::vector<uint8_t> *got = nullptr) {
    c.SendFrame(w::EncodeRequest(w::kRead, q, 2), datadist::After(2));
    std::vector<uint8_t> p;
    w::Header h = c.RecvFrame(p, datadist::After(2));
    int64_t code = 0;
    if (h.type == w::kError) {
      code = w::DecodeError(p).code;
    } else {
      EXPECT_EQ(h.type, w::kReadData);
      std::vector<uint8_t> buf(w::DecodeU64(p));
      c.RecvV({{buf.data(), buf.size()}}, datadist::After(2));
      if (got) *got = buf;
    }
    Ping(c);
    return code;
  }
  static void Ping(datadist::Conn &c) {
    c.SendFrame(w::EncodeU64(w::kPing, 77, 3), datadist::After(2));
    std::vector<uint8_t> p;
    EXPECT_EQ(c.RecvFrame(p, datadist::After(2)).type, w::kPong);
  }
  datadist::Identity ident;
  std::unique_ptr<datadist::Server> server;
  std::unique_ptr<datadist::Conn> conn;
};

// Python: the TCP server closes a READ's lease ok once its bytes are sent (tcp.py _dispatch:
// close_read(lease, ok)), which consumes its req_id key. Before, the C++ server ended the
// lease without a verdict and no key was ever consumed.
TEST_F(Served, AReadSentOverTcpConsumesItsKey) {
  HostCache mem(4, {4, 256});
  mem.Fill(3);
  reg.Add(1, mem.desc, mem.addrs, kPool);
  Bind(1, {K(5)}, {1});
  std::vector<uint8_t> got;
  ASSERT_EQ(Read(*conn, ByKey(5), &got), 0);
  ASSERT_EQ(got.size(), 4U * 256);
  EXPECT_EQ(got[0], HostCache::Byte(3, 0, 256));
  EXPECT_EQ(Consumed(), std::vector<KeyId>{K(5)});
  EXPECT_EQ(Read(*conn, ByKey(5)), static_cast<int64_t>(LLM_KV_CACHE_NOT_EXIST));
}

// Python: tcp.py _write opens a WRITE as a write (Registry.open(read=False)) after
// Engine._check_writable. Before, the C++ server opened it as a read.
TEST_F(Served, WritesAreRefusedWhenRemoteWritesAreOff) {
  HostCache mem(4, {4, 256});
  reg.Add(1, mem.desc, mem.addrs, kPool);
  Bind(1, {K(5)}, {0});
  reg.SetRemoteWrites(false);
  w::Request q = ByKey(5);
  conn->SendFrame(w::EncodeRequest(w::kWrite, q, 4), datadist::After(2));
  std::vector<uint8_t> p;
  ASSERT_EQ(conn->RecvFrame(p, datadist::After(2)).type, w::kError);
  w::ErrorMsg e = w::DecodeError(p);
  EXPECT_EQ(e.code, static_cast<int64_t>(LLM_PARAM_INVALID));
  EXPECT_NE(e.message.find("enable_remote_cache_accessible"), std::string::npos) << e.message;
}

// Python: a GRANT's read is settled by the reader's RELEASE (tcp.py: close_read(lease, msg.ok)):
// ok consumes the key, not ok does not. Before, the C++ server dropped every grant unsettled.
TEST_F(Served, AGrantReleasedOkConsumesItsKey) {
  if (!server->serves_local()) GTEST_SKIP() << "no local channel here";
  auto local =
      Hello(datadist::local::Connect(datadist::local::Name(static_cast<uint64_t>(getpid()), 9), datadist::After(2)));
  HostCache mem(4, {4, 256});
  reg.Add(1, mem.desc, mem.addrs, kPool);
  Bind(1, {K(5), K(6)}, {0, 1});
  for (uint64_t req : {5, 6}) {
    w::Request q = ByKey(req);
    q.flags = w::kFlagGrant;
    local->SendFrame(w::EncodeRequest(w::kRead, q, 5), datadist::After(2));
    std::vector<uint8_t> p;
    w::Header h = local->RecvFrame(p, datadist::After(2));
    if (h.type == w::kError) GTEST_SKIP() << "grants refused here: " << w::DecodeError(p).message;
    ASSERT_EQ(h.type, w::kGrant);
    const w::Grant g = w::DecodeGrant(p);
    local->SendFrame(w::EncodeRelease({g.lease_id, req == 5}, 6), datadist::After(2));
    Ping(*local);
  }
  EXPECT_EQ(Consumed(), std::vector<KeyId>{K(5)});  // K(6)'s reader said not ok
  EXPECT_EQ(Read(*conn, ByKey(6)), 0);
}

// A request's layout tag is the peer's to send: a type code past DataType's range names no
// type (the owner's fuzzer found the cast of one: undefined behaviour under UBSan).
TEST(Registry, ALayoutTagPastTheTypesIsPlainBytes) {
  EXPECT_EQ(datadist::InElements(8192, (uint64_t{0xFFFFFFFF} << 32) | 1), "8192 bytes");
  EXPECT_EQ(datadist::InElements(8192, (uint64_t{1000} << 32) | 1), "8192 bytes");
  EXPECT_EQ(datadist::InElements(8192, (uint64_t{ge::DT_FLOAT16 + 1} << 32) | 1),
            "4096 DT_FLOAT16 elements (8192 bytes)");
}

}  // namespace

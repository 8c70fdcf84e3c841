// datadist._core.PlannedPulls: the Python face's planned pulls (datadist/api/planned.py), kept
// by their arguments, with the hit path in one call: the key built here from the arguments the
// caller passed, its prepared call looked up, then run (or handed back, for the issued forms).
//
// What may be a key is the safety of this map (api/planned.py's docstring; the rules are the
// same as when the key was built in Python): only values whose every check is a pure function
// of the key and whose type is exactly the one the checks accept. The remote cache's key by
// its class exactly (BlocksCacheKey, CacheKeyByIdAndIndex, CacheKey, the classes the map is
// made with) and its int fields; a block list as an exact list or tuple of at most
// `small_request` exact ints in [0, 2**64); batch_index and size exact ints; the layer
// keywords (src_layer_range, dst_layer_range, tensor_num_per_layer, nothing else) each as an
// exact range (start, stop, step), an exact int or None. Every int within 64 bits (its sign
// part of the key). Anything else (a subclass, a bool, a numpy array, an unknown keyword) has
// no key: the caller takes the full path, which checks everything and raises what is wrong.
// The destination Cache is part of the key by identity, held by its entry (its address cannot
// name another object while kept). What the key cannot cover, the caller checks before every
// call (its session open), the engine when it closes (Close: nothing found from then on) and
// the core on every run (the local cache
// still registered with the addresses the call was made for: Session::Run).
//
// Kept: at most `size` calls, and `max_weight` local spans in all (the newest always), the
// least recently used going first with a second chance (a hit marks its entry; an eviction
// pass moves a marked entry to the end unmarked), as api/planned.py's map did.
//
// Who calls: datadist.api.cache_manager.CacheManager, one map per manager, with the GIL held
// (every method keeps it but run_*'s transfer, which gives it up only where the core waits,
// gil.h: the call run is a copy of the shared pointer, so an eviction meanwhile is safe).
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gil.h"
#include "net.h"
#include "session.h"

namespace datadist_py {

namespace planned_detail {

namespace py = pybind11;

struct WordsHash {
  size_t operator()(const std::vector<uint64_t> &w) const noexcept {
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint64_t x : w) {
      h ^= x;
      h *= 0x100000001b3ull;
      h ^= h >> 29;
    }
    return static_cast<size_t>(h);
  }
};

/// An exact int within 64 bits, appended as its value and its sign; false otherwise.
inline bool PushInt(PyObject *o, std::vector<uint64_t> *w) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow == 0) {
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    w->push_back(static_cast<uint64_t>(v));
    w->push_back(v < 0 ? 1 : 0);
    return true;
  }
  if (overflow < 0) return false;
  const unsigned long long u = PyLong_AsUnsignedLongLong(o);
  if (u == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  w->push_back(u);
  w->push_back(0);
  return true;
}

/// The int attribute `name` of `o` (PushInt); false when it has none.
inline bool PushAttr(PyObject *o, PyObject *name, std::vector<uint64_t> *w) {
  PyObject *v = PyObject_GetAttr(o, name);
  if (v == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool ok = PushInt(v, w);
  Py_DECREF(v);
  return ok;
}

}  // namespace planned_detail

/// An argument the map takes as it comes (whatever its type: the key says what it accepts),
/// typed `object` in the stub.
class Arg : public pybind11::object {
 public:
  using pybind11::object::object;
  static bool check_(pybind11::handle) { return true; }
};

class PlannedPulls {
 public:
  using Call = datadist::Call;

  /// `core`: the Engine's session, which the binding keeps alive as long as this map.
  PlannedPulls(datadist::Session &core, size_t size, size_t max_weight, size_t small_request,
               pybind11::type blocks_key_type, pybind11::type by_id_key_type, pybind11::type cache_key_type)
      : core_(&core),
        size_(size),
        max_weight_(max_weight),
        small_request_(small_request),
        types_{std::move(blocks_key_type), std::move(by_id_key_type), std::move(cache_key_type)} {
    static const char *const kNames[] = {"_cluster_id",
                                         "_model_id",
                                         "_cache_id",
                                         "_batch_index",
                                         "_req_id",
                                         "_prefix_id",
                                         "src_layer_range",
                                         "dst_layer_range",
                                         "tensor_num_per_layer",
                                         "start",
                                         "stop",
                                         "step"};
    for (size_t i = 0; i < names_.size(); ++i)
      names_[i] = pybind11::reinterpret_steal<pybind11::object>(PyUnicode_InternFromString(kNames[i]));
    scratch_.reserve(64);
  }

  /// pull_blocks's hit: its kept call run (true), or nothing done (false: no key, or none kept).
  bool RunBlocks(pybind11::handle key, pybind11::handle cache, pybind11::handle src, pybind11::handle dst,
                 pybind11::handle kwargs, double timeout_s) {
    if (!BlocksKey(key, cache, src, dst, kwargs)) return false;
    return RunFound(timeout_s);
  }
  std::optional<std::shared_ptr<Call>> FindBlocks(const Arg &key, const Arg &cache, const Arg &src, const Arg &dst,
                                                  const Arg &kwargs) {
    if (!BlocksKey(key, cache, src, dst, kwargs)) return std::nullopt;
    return Found();
  }
  bool PutBlocks(const Arg &key, const Arg &cache, const Arg &src, const Arg &dst, const Arg &kwargs,
                 std::shared_ptr<Call> call) {
    if (!BlocksKey(key, cache, src, dst, kwargs)) return false;
    Put(cache, std::move(call));
    return true;
  }

  /// pull_cache's hit, as RunBlocks.
  bool RunSlot(pybind11::handle key, pybind11::handle cache, pybind11::handle batch_index, pybind11::handle size,
               pybind11::handle kwargs, double timeout_s) {
    if (!SlotKey(key, cache, batch_index, size, kwargs)) return false;
    return RunFound(timeout_s);
  }
  std::optional<std::shared_ptr<Call>> FindSlot(const Arg &key, const Arg &cache, const Arg &batch_index,
                                                const Arg &size, const Arg &kwargs) {
    if (!SlotKey(key, cache, batch_index, size, kwargs)) return std::nullopt;
    return Found();
  }
  bool PutSlot(const Arg &key, const Arg &cache, const Arg &batch_index, const Arg &size, const Arg &kwargs,
               std::shared_ptr<Call> call) {
    if (!SlotKey(key, cache, batch_index, size, kwargs)) return false;
    Put(cache, std::move(call));
    return true;
  }

  void Clear() {
    items_.clear();
    order_.clear();
    total_ = 0;
  }
  /// The engine is closing: nothing is found or kept from now.
  void Close() {
    open_ = false;
    Clear();
  }
  size_t size() const { return items_.size(); }
  size_t total() const { return total_; }

 private:
  struct Entry {
    std::vector<uint64_t> key;
    pybind11::object cache;  // held: its address, in the key, names it while kept
    std::shared_ptr<Call> call;
    size_t weight = 0;
    bool used = false;  // found since an eviction pass last passed over it
  };
  enum Name : size_t {
    kClusterId,
    kModelId,
    kCacheId,
    kBatchIndex,
    kReqId,
    kPrefixId,
    kSrcRange,
    kDstRange,
    kTensorNum,
    kStart,
    kStop,
    kStep
  };

  PyObject *name(Name n) const { return names_[n].ptr(); }

  /// The remote cache's key: its class's tag and int fields; false: not one of the classes exactly.
  bool PushKey(PyObject *k) {
    PyObject *t = reinterpret_cast<PyObject *>(Py_TYPE(k));
    using planned_detail::PushAttr;
    if (t == types_[0].ptr()) {
      scratch_.push_back(1);
      return PushAttr(k, name(kClusterId), &scratch_) && PushAttr(k, name(kModelId), &scratch_);
    }
    if (t == types_[1].ptr()) {
      scratch_.push_back(2);
      return PushAttr(k, name(kClusterId), &scratch_) && PushAttr(k, name(kCacheId), &scratch_) &&
             PushAttr(k, name(kBatchIndex), &scratch_);
    }
    if (t == types_[2].ptr()) {
      scratch_.push_back(3);
      return PushAttr(k, name(kClusterId), &scratch_) && PushAttr(k, name(kReqId), &scratch_) &&
             PushAttr(k, name(kModelId), &scratch_) && PushAttr(k, name(kPrefixId), &scratch_);
    }
    return false;
  }

  /// A block list: its length and items; false: not an exact list or tuple of at most
  /// small_request_ exact ints in [0, 2**64).
  bool PushBlocks(PyObject *b) {
    if (!PyList_CheckExact(b) && !PyTuple_CheckExact(b)) return false;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(b);
    if (static_cast<size_t>(n) > small_request_) return false;
    PyObject **items = PySequence_Fast_ITEMS(b);
    scratch_.push_back(static_cast<uint64_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!PyLong_CheckExact(items[i])) return false;
      const unsigned long long v = PyLong_AsUnsignedLongLong(items[i]);
      if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
      }
      scratch_.push_back(v);
    }
    return true;
  }

  /// The layer keywords, in a fixed order whatever the caller's (each read by its name):
  /// per name absent (0), None (1), an exact int (2, its value) or an exact range (3, its
  /// start, stop and step); false: another name or value type.
  bool PushKwargs(PyObject *kw) {
    if (!PyDict_CheckExact(kw)) return false;
    if (PyDict_GET_SIZE(kw) == 0) {
      scratch_.push_back(0);
      return true;
    }
    PyObject *slot[3] = {nullptr, nullptr, nullptr};
    Py_ssize_t pos = 0;
    PyObject *k = nullptr;
    PyObject *v = nullptr;
    while (PyDict_Next(kw, &pos, &k, &v)) {
      size_t i = 0;
      for (; i < 3; ++i) {
        PyObject *want = name(static_cast<Name>(kSrcRange + i));
        if (k == want || (PyUnicode_CheckExact(k) && PyUnicode_Compare(k, want) == 0)) break;
      }
      if (i == 3) return false;
      slot[i] = v;
    }
    scratch_.push_back(1);
    for (PyObject *s : slot) {
      if (s == nullptr) {
        scratch_.push_back(0);
      } else if (s == Py_None) {
        scratch_.push_back(1);
      } else if (PyLong_CheckExact(s)) {
        scratch_.push_back(2);
        if (!planned_detail::PushInt(s, &scratch_)) return false;
      } else if (Py_IS_TYPE(s, &PyRange_Type)) {
        scratch_.push_back(3);
        if (!planned_detail::PushAttr(s, name(kStart), &scratch_) ||
            !planned_detail::PushAttr(s, name(kStop), &scratch_) ||
            !planned_detail::PushAttr(s, name(kStep), &scratch_))
          return false;
      } else {
        return false;
      }
    }
    return true;
  }

  bool BlocksKey(pybind11::handle key, pybind11::handle cache, pybind11::handle src, pybind11::handle dst,
                 pybind11::handle kwargs) {
    if (!open_) return false;
    scratch_.clear();
    scratch_.push_back(1);  // pull_blocks
    scratch_.push_back(reinterpret_cast<uintptr_t>(cache.ptr()));
    if (!PushKey(key.ptr()) || !PushBlocks(src.ptr())) return false;
    if (dst.ptr() == src.ptr()) {  // one list as both: the same words again
      const size_t n = scratch_.size();
      const size_t len = static_cast<size_t>(PySequence_Fast_GET_SIZE(src.ptr())) + 1;
      for (size_t i = n - len; i < n; ++i) scratch_.push_back(scratch_[i]);
    } else if (!PushBlocks(dst.ptr())) {
      return false;
    }
    return PushKwargs(kwargs.ptr());
  }

  bool SlotKey(pybind11::handle key, pybind11::handle cache, pybind11::handle batch_index, pybind11::handle size,
               pybind11::handle kwargs) {
    if (!open_) return false;
    scratch_.clear();
    scratch_.push_back(2);  // pull_cache
    scratch_.push_back(reinterpret_cast<uintptr_t>(cache.ptr()));
    return PushKey(key.ptr()) && planned_detail::PushInt(batch_index.ptr(), &scratch_) &&
           planned_detail::PushInt(size.ptr(), &scratch_) && PushKwargs(kwargs.ptr());
  }

  /// The entry of scratch_'s key, marked used; nullptr when none.
  Entry *Find() {
    auto it = items_.find(scratch_);
    if (it == items_.end()) return nullptr;
    it->second->used = true;
    return &*it->second;
  }

  std::optional<std::shared_ptr<Call>> Found() {
    Entry *e = Find();
    if (e == nullptr) return std::nullopt;
    return e->call;
  }

  bool RunFound(double timeout_s) {
    Entry *e = Find();
    if (e == nullptr) return false;
    const std::shared_ptr<Call> call = e->call;  // kept through the run, whatever is evicted meanwhile
    RunHeld(*core_, *call, timeout_s);           // as Engine.run
    return true;
  }

  /// Keeps `call` for scratch_'s key (replacing what was kept), then evicts down to the bounds
  /// (never that key's entry).
  void Put(pybind11::handle cache, std::shared_ptr<Call> call) {
    auto old = items_.find(scratch_);
    if (old != items_.end()) {
      total_ -= old->second->weight;
      order_.erase(old->second);
      items_.erase(old);
    }
    Entry e;
    e.key = scratch_;
    e.cache = pybind11::reinterpret_borrow<pybind11::object>(cache);
    e.weight = call->iov.size();
    e.call = std::move(call);
    total_ += e.weight;
    order_.push_back(std::move(e));
    auto newest = std::prev(order_.end());
    items_.emplace(newest->key, newest);
    while (items_.size() > size_ || (total_ > max_weight_ && items_.size() > 1)) {
      auto front = order_.begin();
      if (front->used || front == newest) {  // used since last passed over: a second chance
        front->used = false;
        order_.splice(order_.end(), order_, front);
        continue;
      }
      total_ -= front->weight;
      items_.erase(front->key);
      order_.erase(front);
    }
  }

  datadist::Session *core_;
  size_t size_;
  size_t max_weight_;
  size_t small_request_;
  std::array<pybind11::type, 3> types_;
  std::array<pybind11::object, 12> names_;
  std::vector<uint64_t> scratch_;  // the key being built (the GIL held: one caller at a time)
  std::list<Entry> order_;         // oldest first
  std::unordered_map<std::vector<uint64_t>, std::list<Entry>::iterator, planned_detail::WordsHash> items_;
  size_t total_ = 0;
  bool open_ = true;
};

}  // namespace datadist_py

template <>
struct pybind11::detail::handle_type_name<datadist_py::Arg> {
  static constexpr auto name = const_name("builtins.object");
};

namespace datadist_py {

namespace planned_detail {

/// run_blocks / run_slot as METH_FASTCALL methods: every pull's hit passes here, and
/// pybind11's dispatch of six arguments cost ~3k instructions, as much as the transfer's own
/// share of the binding and the core (docs/performance.md, "Round 15: the small pull's Python
/// face"). Six positional arguments, as the pybind11 form took them; the core's errors leave
/// through the module's exception translators, as from any pybind11 call.
template <bool kBlocks>
PyObject *RunFast(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  try {
    if (nargs != 6) {
      PyErr_Format(PyExc_TypeError, "%s takes 6 positional arguments (%zd given)", kBlocks ? "run_blocks" : "run_slot",
                   nargs);
      return nullptr;
    }
    const double timeout_s = PyFloat_AsDouble(args[5]);
    if (timeout_s == -1.0 && PyErr_Occurred()) return nullptr;
    auto *m = pybind11::handle(self).cast<PlannedPulls *>();
    const bool ran = kBlocks ? m->RunBlocks(pybind11::handle(args[0]), args[1], args[2], args[3], args[4], timeout_s)
                             : m->RunSlot(args[0], args[1], args[2], args[3], args[4], timeout_s);
    return pybind11::bool_(ran).release().ptr();
  } catch (...) {
    pybind11::detail::try_translate_exceptions();
    return nullptr;
  }
}

}  // namespace planned_detail

/// Binds PlannedPulls into `m`, after Engine (its first argument) is bound.
inline void BindPlanned(pybind11::module_ &m) {
  namespace py = pybind11;
  py::class_<PlannedPulls> cls(m, "PlannedPulls",
                               "A CacheManager's planned pulls by their arguments (cpp/python/planned.h): the hit "
                               "path of pull_blocks / pull_cache in one call");
  cls.def(py::init<datadist::Session &, size_t, size_t, size_t, py::type, py::type, py::type>(), py::arg("engine"),
          py::arg("size"), py::arg("max_weight"), py::arg("small_request"), py::arg("blocks_key_type"),
          py::arg("by_id_key_type"), py::arg("cache_key_type"), py::keep_alive<1, 2>())
      .def("find_blocks", &PlannedPulls::FindBlocks, py::arg("key"), py::arg("cache"), py::arg("src_blocks"),
           py::arg("dst_blocks"), py::arg("kwargs"),
           "pull_blocks's kept call for these arguments (marked used), or None. Never blocks.")
      .def("put_blocks", &PlannedPulls::PutBlocks, py::arg("key"), py::arg("cache"), py::arg("src_blocks"),
           py::arg("dst_blocks"), py::arg("kwargs"), py::arg("call"),
           "Keeps `call` for these pull_blocks arguments, checked by the caller; False: they have no key.")
      .def("find_slot", &PlannedPulls::FindSlot, py::arg("key"), py::arg("cache"), py::arg("batch_index"),
           py::arg("size"), py::arg("kwargs"), "pull_cache's kept call for these arguments, or None.")
      .def("put_slot", &PlannedPulls::PutSlot, py::arg("key"), py::arg("cache"), py::arg("batch_index"),
           py::arg("size"), py::arg("kwargs"), py::arg("call"),
           "Keeps `call` for these pull_cache arguments; False: no key.")
      .def("clear", &PlannedPulls::Clear, "Forgets every kept call.")
      .def("close", &PlannedPulls::Close, "Forgets every kept call and keeps none from now (the engine closes).")
      .def("__len__", &PlannedPulls::size)
      .def_property_readonly("total", &PlannedPulls::total, "the kept calls' local spans");
  static PyMethodDef fast[] = {
      {"run_blocks", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&planned_detail::RunFast<true>)),
       METH_FASTCALL,
       "run_blocks(self, key: builtins.object, cache: builtins.object, src_blocks: builtins.object, dst_blocks: "
       "builtins.object, kwargs: builtins.object, timeout_s: typing.SupportsFloat | typing.SupportsIndex) -> bool\n\n"
       "pull_blocks(key, cache, src_blocks, dst_blocks, kwargs)'s kept call, run on the engine as Engine.run does "
       "(True); False, doing nothing, when the arguments have no key or none is kept. Positional."},
      {"run_slot", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&planned_detail::RunFast<false>)),
       METH_FASTCALL,
       "run_slot(self, key: builtins.object, cache: builtins.object, batch_index: builtins.object, size: "
       "builtins.object, kwargs: builtins.object, timeout_s: typing.SupportsFloat | typing.SupportsIndex) -> bool\n\n"
       "pull_cache(key, cache, batch_index, size, kwargs)'s kept call, run as run_blocks."},
  };
  for (PyMethodDef &def : fast) {
    PyObject *descr = PyDescr_NewMethod(reinterpret_cast<PyTypeObject *>(cls.ptr()), &def);
    if (descr == nullptr) throw py::error_already_set();
    cls.attr(def.ml_name) = py::reinterpret_steal<py::object>(descr);
  }
}

}  // namespace datadist_py

// datadist._core: the Python package's binding of the C++ core's session (cpp/src/session.h:
// the engine, its asynchronous workers, and the rules both faces share).
//
// A thin layer: no argument rules of CANN's API live here (the Python facade, datadist/api,
// checks them and builds the plans), and no rule of the core's (unlinking, linking many,
// a transfer's cap and counting: session.h); this file converts arrays, releases the GIL around
// everything that can block, and raises every datadist::Error as the package's own error
// class (datadist.core.errors) from one code-to-class table (PyError).
//
// Who calls: datadist.core.native.NativeEngine only. Serving (accepting, handshakes, peers'
// requests, reverse channels, leases) runs on the engine's own threads and never takes the
// GIL; transfers issued here keep it until the core would wait (gil.h); asynchronous ones run on a
// fixed set of worker threads and are polled through Handle (its wait keeps the GIL for a short
// budget only, gil.h).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/typing.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "engine.h"
#include "errors.h"
#include "gil.h"
#include "metrics.h"
#include "nixl.h"
#include "options.h"
#include "planned.h"
#include "pool.h"
#include "session.h"
#include "tasks.h"
#include "testing.h"
#include "threads.h"
#include "wire.h"

namespace py = pybind11;

#ifndef DATADIST_VERSION
#error "DATADIST_VERSION is defined by the top-level CMakeLists.txt"
#endif

namespace {

using datadist::Deadline;

using U32Array = py::array_t<uint32_t, py::array::c_style | py::array::forcecast>;
using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

Deadline DeadlineIn(double seconds) { return datadist::After(seconds < 0 ? 0 : seconds); }

std::vector<uint64_t> ToVector(const U64Array &a) {
  const uint64_t *p = a.data();
  return std::vector<uint64_t>(p, p + a.size());
}

/// A block list as prepare_pull / prepare_push / prepare_layer_pushes take it: a view of the
/// caller's numpy buffer when it is C-contiguous, aligned, native-order 64-bit integers (uint64,
/// or int64, whose negative items read as their uint64 wrap, as numpy's cast makes them);
/// anything else (a list, another dtype, strides) converted to uint64 once, as U64Array. The
/// planner reads it while the call holds the GIL (Session::PreparePull never lets it go), so
/// nothing changes the buffer meanwhile, and keeps nothing of it: the plan copies what it needs.
/// A view instead of a vector: a 100k-block pull copied 1.6 MB of lists, which kept each
/// call's freed memory above glibc's trim threshold (docs/performance.md, "Round 12").
struct BlockIds {
  py::object keep;  // the array viewed, or the converted copy
  datadist::Blocks view;
};

}  // namespace

namespace pybind11::detail {
template <>
struct type_caster<BlockIds> {
  PYBIND11_TYPE_CASTER(BlockIds, const_name("numpy.typing.NDArray[numpy.uint64]"));
  bool load(handle src, bool convert) {
    if (isinstance<array>(src)) {
      auto a = reinterpret_borrow<array>(src);
      const dtype dt = a.dtype();
      const int need = array::c_style | npy_api::NPY_ARRAY_ALIGNED_;
      if ((a.flags() & need) == need && dt.itemsize() == 8 && (dt.kind() == 'u' || dt.kind() == 'i') &&
          dt.byteorder() != '>') {
        value.view = datadist::Blocks::Of(static_cast<const uint64_t *>(a.data()), static_cast<size_t>(a.size()));
        value.keep = std::move(a);
        return true;
      }
    }
    if (!convert) return false;
    U64Array a = U64Array::ensure(src);  // a copy (ensure clears the error of what it refuses)
    if (!a) return false;
    value.view = datadist::Blocks::Of(a.data(), static_cast<size_t>(a.size()));
    value.keep = std::move(a);
    return true;
  }
  static handle cast(const BlockIds &, return_value_policy, handle) = delete;
};
}  // namespace pybind11::detail

namespace {

/// The request naming a remote cache by the Python face's key (datadist.core.keys.KeyRef:
/// kind, a, b, c), as prepare_pull / prepare_push / prepare_layer_pushes state it; the core
/// sets the rest.
datadist::wire::Request KeyRequest(uint8_t key_kind, uint64_t a, uint64_t b, uint64_t c) {
  datadist::wire::Request req;
  req.kind = key_kind;
  req.a = a;
  req.b = b;
  req.c = c;
  return req;
}

/// (op, cluster_id, transfers, bytes, {status name: count}, bucket counts, nanoseconds) per series.
using MetricsTable =
    py::typing::List<py::typing::Tuple<py::str, uint64_t, uint64_t, uint64_t, py::typing::Dict<py::str, uint64_t>,
                                       py::typing::List<uint64_t>, uint64_t>>;

/// The core's series as Python's datadist.core.metrics reads them: (op, cluster_id,
/// transfers, bytes, {status name: count}, per-bucket counts (not cumulative, the last above
/// all), nanoseconds summed).
MetricsTable MetricsSeries() {
  std::vector<datadist::metrics::Series> all;
  {
    py::gil_scoped_release nogil;
    all = datadist::metrics::Snapshot();
  }
  py::list out;
  for (const auto &s : all) {
    py::dict errors;
    for (const auto &e : s.errors) errors[py::str(e.first)] = e.second;
    py::list counts;
    for (uint64_t n : s.counts) counts.append(n);
    out.append(
        py::make_tuple(datadist::metrics::OpName(s.op), s.cluster_id, s.transfers, s.bytes, errors, counts, s.nanos));
  }
  return out;
}

/// The engine Python drives: the core's session (session.h), the one seam both faces call.
using Core = datadist::Session;
using datadist::Call;

/// A datadist.core.errors.DatadistError (PyError's result), named so in the stub (handle_type_name below).
class ErrorObject : public py::object {
 public:
  using py::object::object;
  ErrorObject(const py::object &o) : py::object(o) {}  // NOLINT: implicit, as pybind11's own wrappers
};

/// A parsed option's value: bool, int or str by its row's kind.
using OptionValue = py::typing::Union<bool, int64_t, py::str>;
/// parse_options' answer: {key: (value, source)}.
using ParsedOptions = py::typing::Dict<py::str, py::typing::Tuple<OptionValue, py::str>>;

/// A local transfer's hold on one of the registry's caches (Engine.hold): Remove waits for it.
/// Released by release() or when Python drops it. Holds the Python Engine (declared first, so
/// destroyed after the lease): the registry the lease ends in outlives it.
struct Hold {
  py::object engine;
  std::unique_ptr<datadist::Lease> lease;
  int64_t cache_id = 0;
};

/// Memory the caller describes for a local copy but never files (Python's create_cpu_cache):
/// its geometry and tensor bases, checked when made (datadist::CheckUnfiled). The caller keeps
/// it mapped while a copy uses it.
struct UserCache {
  datadist::Geometry geo;
  std::vector<uint64_t> addrs;
};

/// One side of Engine.copy_slot / copy_blocks: a filed cache's id, or unfiled memory.
using CopySideArg = std::variant<int64_t, UserCache>;

datadist::CopySide ToCopySide(const CopySideArg &arg) {
  datadist::CopySide side;
  if (const int64_t *id = std::get_if<int64_t>(&arg)) {
    // an id below 0 names no cache (and must not be read as "unfiled")
    if (*id < 0)
      datadist::Fail(llm_datadist::LLM_KV_CACHE_NOT_EXIST, "cache " + std::to_string(*id) + " does not exist");
    side.cache_id = *id;
  } else {
    const UserCache &u = std::get<UserCache>(arg);
    side.geo = u.geo;
    side.addrs = u.addrs;
  }
  return side;
}

/// add_cache's keys as Python passes them: (value, model_id, is_prefix) or None per slot.
using KeyList = std::vector<std::optional<std::tuple<uint64_t, uint64_t, bool>>>;

/// A cache's geometry from what the Python face states of it (unit_bytes derived: 0 without units).
datadist::Geometry GeometryOf(uint32_t num_tensors, uint64_t tensor_bytes, uint64_t units, uint64_t layout = 0) {
  datadist::Geometry g;
  g.num_tensors = num_tensors;
  g.tensor_bytes = tensor_bytes;
  g.units = units;
  g.unit_bytes = units ? tensor_bytes / units : 0;
  g.layout = layout;
  return g;
}

/// add_cache's keys, from slot 0, as the registry's keys and their slots; the Nones (padding
/// keys) bind nothing.
void KeysOf(const KeyList &keys, std::vector<datadist::KeyId> *out, std::vector<uint64_t> *slots) {
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!keys[i]) continue;
    const auto &[value, model_id, is_prefix] = *keys[i];
    out->push_back({value, model_id, is_prefix});
    slots->push_back(i);
  }
}

/// The package's error for a core error: the binding's one code-to-class table. A checksum
/// mismatch (its kind, not its code, which a peer's protocol error shares) is IntegrityError;
/// the codes below their class; any other code RemoteError with that code (FAILED where
/// datadist.core.errors.Code has none). Called with the GIL held (the exception translator,
/// Handle.error); imports datadist.core.errors on first use.
py::object PyError(datadist::Status code, const std::string &message, datadist::ErrorKind kind) {
  struct Row {
    datadist::Status code;
    const char *cls;
  };
  static constexpr Row kClasses[] = {
      {llm_datadist::LLM_KV_CACHE_NOT_EXIST, "CacheNotFound"},
      {llm_datadist::LLM_PARAM_INVALID, "InvalidArgument"},
      {llm_datadist::LLM_TIMEOUT, "Timeout"},
      {llm_datadist::LLM_NOT_YET_LINK, "NotLinked"},
      {llm_datadist::LLM_ALREADY_LINK, "AlreadyLinked"},
      {llm_datadist::LLM_LINK_FAILED, "LinkFailed"},
      {llm_datadist::LLM_LINK_BUSY, "Busy"},
      {llm_datadist::LLM_FEATURE_NOT_ENABLED, "NotSupported"},
      {llm_datadist::LLM_OUT_OF_MEMORY, "OutOfMemory"},
  };
  const char *cls = "RemoteError";
  if (kind == datadist::ErrorKind::kChecksumMismatch) {
    cls = "IntegrityError";
  } else {
    for (const Row &row : kClasses)
      if (row.code == code) cls = row.cls;
  }
  py::module_ errors = py::module_::import("datadist.core.errors");
  py::object known;
  try {
    known = errors.attr("Code")(code);
  } catch (py::error_already_set &) {  // a code the package does not name
    known = errors.attr("Code").attr("FAILED");
  }
  return errors.attr(cls)(message, py::arg("code") = known);
}

}  // namespace

template <>
struct pybind11::detail::handle_type_name<ErrorObject> {
  static constexpr auto name = const_name("datadist.core.errors.DatadistError");
};

PYBIND11_MODULE(_core, m) {
  m.doc() =
      "datadist's C++ engine (private: datadist.core.native drives it). Every error of the core is raised as "
      "datadist.core.errors' class for its code (one code-to-class table, module.cc PyError); a checksum mismatch "
      "as IntegrityError. Hooks for tests and tools: the `testing` submodule.";
  m.attr("__version__") = DATADIST_VERSION;
  // How this module was built, for `datadist info` and bug reports. Called by Python at any
  // time; returns at once.
  m.def(
      "build_info",
      []() -> py::typing::Dict<py::str, py::str> {
        py::dict info;
        info["compiler"] = DATADIST_CXX_COMPILER;
        info["build_type"] = DATADIST_BUILD_TYPE;
        info["pybind11"] = DATADIST_PYBIND11_VERSION;
        // The protocol version as datadist_core's codec writes it (byte 2 of a frame's
        // header): a call into the linked core.
        info["protocol"] = std::to_string(datadist::wire::EncodeEmpty(datadist::wire::kOk, 0).at(2));
        return info;
      },
      "A dict: compiler, build_type, pybind11 (what it was built with), protocol (the core's wire version).");

  // Called by core/native.py refusal() and `datadist info`; returns at once.
  m.def(
      "tls",
      []() -> py::typing::Tuple<bool, py::str> {
        return py::make_tuple(datadist::tls::Available(), datadist::tls::Describe());
      },
      "(available, what): does this build have TLS, and the OpenSSL it runs with (or why not).");
  // Called by datadist.set_thread_cpus (core/threads.py), usually before the first engine;
  // returns at once. Threads the core starts later run on these CPUs (empty: their creator's).
  m.def(
      "set_thread_cpus", [](std::vector<int> cpus) { datadist::SetThreadCpus(std::move(cpus)); }, py::arg("cpus"),
      "The CPUs the core's threads started from now on run on (empty: those of the thread that starts them).");
  m.def(
      "thread_cpus", [] { return datadist::ThreadCpus(); },
      "What set_thread_cpus set last (empty: the core's threads take their creator's CPUs).");
  // Called by core/native.py with the nixl-cu12 wheel's libnixl_capi.so before an engine
  // that serves NIXL opens; loads it once per process (without the GIL: NIXL's constructors).
  m.def(
      "nixl_load",
      [](const std::string &path) -> py::typing::Tuple<bool, py::str> {
        std::string why;
        bool ok;
        {
          py::gil_scoped_release nogil;
          ok = datadist::nixl::Load(path, &why);
        }
        return py::make_tuple(ok, why);
      },
      py::arg("path"), "(loaded, why not): loads NIXL's C API from `path` (the first call wins).");

  // Called by the Python face's register_cache / register_blocks_cache for a DEVICE-placed
  // cache whose range /proc/self/maps does not show readable and writable (GPU memory): is it
  // a CUDA device's? Asks the CUDA runtime the core loads at run time (nixl.h, CudaDevice;
  // the first call may dlopen it), without the GIL.
  m.def(
      "cuda_device",
      [](uint64_t addr) -> std::optional<uint32_t> {
        uint32_t device = 0;
        bool on_device;
        {
          py::gil_scoped_release nogil;
          on_device = datadist::nixl::CudaDevice(addr, &device);
        }
        if (!on_device) return std::nullopt;
        return device;
      },
      py::arg("addr"),
      "The CUDA device whose memory (device or managed) `addr` is, or None: host memory, no CUDA runtime.");

  // The option table (cpp/src/options.h): what LLMConfig's datadist extras and `datadist info`
  // are generated from, and the one parser of the init options both faces use. Called by
  // datadist.api (config, init) and the CLI; they return at once.
  py::class_<datadist::OptionSpec>(m, "OptionSpec", "One row of the option table (read only)")
      .def_property_readonly(
          "key", [](const datadist::OptionSpec &s) { return std::string(s.key); }, "the option's key")
      .def_property_readonly(
          "env", [](const datadist::OptionSpec &s) { return std::string(s.env); },
          "its environment variable (\"\": none)")
      .def_property_readonly(
          "kind", [](const datadist::OptionSpec &s) { return std::string(datadist::KindName(s.kind)); },
          "\"bool\", \"int\", \"enum\", \"str\", \"path\" or \"secret\"")
      .def_property_readonly(
          "values", [](const datadist::OptionSpec &s) { return s.values; }, "an enum's accepted values")
      .def_property_readonly(
          "range",
          [](const datadist::OptionSpec &s) -> py::typing::Optional<py::typing::Tuple<int64_t, int64_t>> {
            if (s.kind != datadist::OptionKind::kInt) return py::none();
            return py::make_tuple(s.lo, s.hi);
          },
          "an int's range, both ends included (None for other kinds)")
      .def_property_readonly("unit", [](const datadist::OptionSpec &s) { return std::string(s.unit); })
      .def_property_readonly("default", [](const datadist::OptionSpec &s) { return std::string(s.def); })
      .def_property_readonly(
          "attr", [](const datadist::OptionSpec &s) { return std::string(s.attr); },
          "the LLMConfig property made for it (\"\": none)")
      .def_property_readonly("doc", [](const datadist::OptionSpec &s) { return std::string(s.doc); })
      .def("__repr__", [](const datadist::OptionSpec &s) { return std::string("<OptionSpec ") + s.key + ">"; });
  m.def(
      "options", [] { return datadist::OptionTable(); }, py::return_value_policy::copy,
      "Every row of the option table, in its order.");
  m.def(
      "parse_options",
      [](const std::map<std::string, std::string> &options, bool environ) -> ParsedOptions {
        const datadist::Options parsed =
            datadist::ParseOptions(options, environ ? datadist::ProcessEnv() : datadist::NoEnv());
        py::dict out;
        for (const auto &spec : datadist::OptionTable()) {
          const datadist::OptionValue &v = parsed.values.at(spec.key);
          py::object value;
          if (v.kind == datadist::OptionKind::kBool)
            value = py::bool_(v.b);
          else if (v.kind == datadist::OptionKind::kInt)
            value = py::int_(v.i);
          else
            value = py::str(v.s);
          out[py::str(spec.key)] = py::make_tuple(value, datadist::SourceName(v.source));
        }
        return out;
      },
      py::arg("options"), py::kw_only(), py::arg("environ") = true,
      "{key: (value, source)} for every row of the table: `options` (str to str) first, then (with "
      "`environ`) the process's environment, then the default; source is 'option', 'env' or 'default'. "
      "InvalidArgument (LLM_PARAM_INVALID) with the table's message for a bad value.");
  m.def(
      "check_option",
      [](const std::string &key, const std::string &value) -> OptionValue {
        const datadist::OptionSpec *spec = datadist::FindOption(key);
        if (spec == nullptr) throw py::key_error(key);
        const datadist::OptionValue v = datadist::CheckValue(*spec, value, key);
        if (v.kind == datadist::OptionKind::kBool) return py::bool_(v.b);
        if (v.kind == datadist::OptionKind::kInt) return py::int_(v.i);
        return py::str(v.s);
      },
      py::arg("key"), py::arg("value"),
      "One value of `key` checked alone (LLMConfig's setters): its parsed value, or "
      "InvalidArgument (LLM_PARAM_INVALID) with the table's message; KeyError for a key the table has not.");

  // Every datadist::Error leaves the core as the package's own error class (PyError's table).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const datadist::Error &e) {
      py::object err = PyError(e.code(), e.what(), e.kind());
      PyErr_SetObject(reinterpret_cast<PyObject *>(Py_TYPE(err.ptr())), err.ptr());
    }
  });

  py::class_<datadist::Task, std::shared_ptr<datadist::Task>>(m, "Handle",
                                                              "An asynchronous transfer, run by the engine's workers")
      .def("done", &datadist::Task::Done, "Ended, successfully or not? Never blocks.")
      .def(
          "wait",
          [](datadist::Task &t, double timeout_s) {
            // The first kWaitBudget holding the GIL (a quick transfer ends within it), the
            // rest without it (gil.h).
            return datadist_py::WaitHeldBriefly(DeadlineIn(timeout_s),
                                                [&](datadist::Deadline until) { return t.Wait(until); });
          },
          py::arg("timeout_s"),
          "Blocks until it ends or timeout_s passes (without the GIL past a short budget, gil.h); True once "
          "ended.")
      .def(
          "error",
          [](datadist::Task &t) -> py::typing::Optional<ErrorObject> {
            if (!t.Done() || t.code() == 0) return py::none();
            return PyError(t.code(), t.message(), t.kind());
          },
          "The error (datadist.core.errors) that ended a failed transfer; None while running or after a "
          "success.");

  py::class_<datadist::Link, std::shared_ptr<datadist::Link>>(
      m, "PendingLink", "A two-sided link's connection, opened and checked but not filed yet (Engine.adopt_link)")
      .def_property_readonly("cluster_id", &datadist::Link::remote_cluster_id)
      .def_property_readonly("path_name", [](datadist::Link &l) { return l.path_name(); })
      .def("close", [](datadist::Link &l) {
        py::gil_scoped_release nogil;
        l.Close(Deadline(), true);
      });

  py::class_<Call, std::shared_ptr<Call>>(m, "Call", "A transfer made ready by Engine.prepare (opaque)")
      .def_property_readonly("write", [](const Call &c) { return c.write; })
      .def_property_readonly("cluster_id", [](const Call &c) { return c.cluster; })
      .def_property_readonly(
          "spans", [](const Call &c) { return c.iov.size(); }, "local spans it holds")
      .def_property_readonly(
          "cache_id", [](const Call &c) { return c.local_cache; }, "the local cache its spans lie in")
      .def_property_readonly(
          "bytes", [](const Call &c) { return c.bytes; }, "the bytes it moves")
      .def_property_readonly(
          "unit_bytes", [](const Call &c) { return c.req.unit_bytes; }, "the unit bytes its request states")
      .def_property_readonly(
          "flags", [](const Call &c) { return c.req.flags; }, "its request's flags (wire.h kFlag*)")
      .def_property_readonly(
          "remote_tensors",
          [](const Call &c) { return U32Array(static_cast<py::ssize_t>(c.req.tensors.size()), c.req.tensors.data()); },
          "its request's remote tensor indices (a copy)")
      .def_property_readonly(
          "remote_offsets",
          [](const Call &c) { return U64Array(static_cast<py::ssize_t>(c.req.offsets.size()), c.req.offsets.data()); },
          "its request's remote span offsets (a copy)")
      .def_property_readonly(
          "lengths",
          [](const Call &c) { return U64Array(static_cast<py::ssize_t>(c.req.lengths.size()), c.req.lengths.data()); },
          "its request's span lengths (a copy)")
      .def_property_readonly(
          "local_iov",
          [](const Call &c) {
            U64Array out({static_cast<py::ssize_t>(c.iov.size()), py::ssize_t{2}});
            auto o = out.mutable_unchecked<2>();
            for (size_t k = 0; k < c.iov.size(); ++k) {
              o(static_cast<py::ssize_t>(k), 0) = reinterpret_cast<uint64_t>(c.iov[k].iov_base);
              o(static_cast<py::ssize_t>(k), 1) = c.iov[k].iov_len;
            }
            return out;
          },
          "its local spans, (address, length) rows in the order the request moves them (a copy)");

  // A local transfer's hold on a cache (Engine.hold): release() ends it (idempotent, never blocks).
  py::class_<Hold>(m, "Hold", "A hold on a local cache (Engine.hold); release() ends it")
      .def_readonly("cache_id", &Hold::cache_id)
      .def("release", [](Hold &h) { h.lease.reset(); })
      .def_property_readonly("held", [](const Hold &h) { return h.lease != nullptr; });

  // ---- local copies (Engine.copy_slot / copy_blocks): the caller's unfiled memory, described once.
  py::class_<UserCache>(
      m, "UserCache",
      "Memory the caller keeps but never filed (create_cpu_cache), as one side of Engine.copy_slot / copy_blocks")
      .def(py::init([](uint32_t num_tensors, uint64_t tensor_bytes, uint64_t units, const U64Array &addrs) {
             UserCache u;
             u.geo = GeometryOf(num_tensors, tensor_bytes, units);
             u.addrs = ToVector(addrs);
             datadist::CheckUnfiled(u.geo, u.addrs);
             return u;
           }),
           py::kw_only(), py::arg("num_tensors"), py::arg("tensor_bytes"), py::arg("units"), py::arg("addrs"),
           "`num_tensors` tensors of `tensor_bytes` bytes, `units` slots or blocks each, at `addrs`. InvalidArgument "
           "for a zero base, a tensor past the end of the address space, or units that do not split a tensor.")
      .def_property_readonly("num_tensors", [](const UserCache &u) { return u.geo.num_tensors; })
      .def_property_readonly("tensor_bytes", [](const UserCache &u) { return u.geo.tensor_bytes; })
      .def_property_readonly("units", [](const UserCache &u) { return u.geo.units; });

  // transfer_cache_async's layer loop in the core (Session::Layers, LayerRun): made by
  // Engine.layers, filled by add / add_refusal, then each step let go from the Python loop
  // thread (go keeps the GIL: a mutex and a hand-over, never a wait).
  py::class_<datadist::LayerRun, std::shared_ptr<datadist::LayerRun>>(
      m, "LayerRun", "A layer-wise transfer whose steps the core runs in order (Engine.layers)")
      .def("add", &datadist::LayerRun::Add, py::arg("step"), py::arg("job"), py::arg("call"),
           "Step `step` sends `call` for destination `job` (before the first go; InvalidArgument after).")
      .def("add_all", &datadist::LayerRun::AddAll, py::arg("first"), py::arg("job"), py::arg("calls"),
           py::arg("per_step"),
           "Every call of destination `job`: calls[i] in step first + i // per_step (add each, under one lock; "
           "none added when one is refused).")
      .def("add_refusal", &datadist::LayerRun::AddRefusal, py::arg("step"), py::arg("job"), py::arg("code"),
           py::arg("why"), "Step `step` fails for destination `job` with `code` when reached.")
      .def("go", &datadist::LayerRun::Go, py::arg("step"),
           "Step `step` may run (in order, once each; InvalidArgument otherwise); returns stopped() after it. "
           "Never blocks.")
      .def("refuse", &datadist::LayerRun::Refuse, py::arg("step"), py::arg("code"), py::arg("why"),
           "Step `step` was not synchronized: applied in order, then the run stops. Never blocks.")
      .def("close", &datadist::LayerRun::Close, "No more steps will be let go. Never blocks.")
      .def("abandon", &datadist::LayerRun::Abandon, py::arg("code"), py::arg("why"),
           "Every destination with a step let go and no outcome gets `code`; nothing more runs.")
      .def("stopped", &datadist::LayerRun::Stopped, "A failure was seen: no later step runs. Never blocks.")
      .def("ended", &datadist::LayerRun::Ended, "Steps ended so far. Never blocks.")
      .def(
          "wait_ended",
          [](datadist::LayerRun &r, size_t steps, double timeout_s) {
            const Deadline deadline = DeadlineIn(timeout_s);
            if (r.WaitEnded(steps, datadist::Clock::time_point::min())) return true;  // no wait: keep the GIL
            py::gil_scoped_release nogil;
            return r.WaitEnded(steps, deadline);
          },
          py::arg("steps"), py::arg("timeout_s"),
          "Blocks (without the GIL, once it must wait) until `steps` steps ended or the run stopped; False "
          "when timeout_s passed first.")
      .def(
          "wait",
          [](datadist::LayerRun &r, double timeout_s) {
            const Deadline deadline = DeadlineIn(timeout_s);
            if (r.Wait(datadist::Clock::time_point::min())) return true;
            py::gil_scoped_release nogil;
            return r.Wait(deadline);
          },
          py::arg("timeout_s"), "Blocks (without the GIL) until the run is over; False when timeout_s passed first.")
      .def(
          "results",
          [](datadist::LayerRun &r) {
            std::vector<std::optional<std::tuple<uint32_t, std::string>>> out;
            for (auto &res : r.Results())
              out.push_back(res.settled ? std::optional(std::make_tuple(static_cast<uint32_t>(res.code), res.why))
                                        : std::nullopt);
            return out;
          },
          "Each destination's outcome: (code, why), or None when it has none (yet).")
      .def_property_readonly("steps", &datadist::LayerRun::steps)
      .def_property_readonly("calls_run", &datadist::LayerRun::calls_run,
                             "Calls the core ran so far (tests: one per destination and layer).")
      .def_property_readonly("requests_run", &datadist::LayerRun::requests_run,
                             "Requests sent so far: layers let go together and merged count one.")
      .def("merges", &datadist::LayerRun::Merges,
           "Some step can be merged with the next (one destination, the same key and spans): letting "
           "layers go ahead pays. Never blocks.");

  py::class_<Core>(
      m, "Engine",
      "An engine (cpp/src/engine.h) and its asynchronous workers: datadist.core.native.NativeEngine drives it")
      .def(py::init<uint64_t, int32_t, size_t>(), py::arg("cluster_id"), py::arg("role"), py::arg("async_threads") = 4)
      .def(
          "open",
          [](Core &c, py::bytes secret, const std::string &transport, bool allow_ptrace, size_t max_conns,
             size_t max_per_peer, const std::string &tls_cert, const std::string &tls_key, const std::string &tls_ca,
             bool nixl_serve, bool nixl_whole_process) {
            datadist::EngineOptions o;
            o.nixl.serve = nixl_serve;
            o.nixl.whole_process = nixl_whole_process;
            o.secret = secret;
            o.allow_ptrace = allow_ptrace;
            o.max_conns = max_conns;
            o.max_per_peer = max_per_peer;
            // The forced path's meaning for links, the rule the C++ API uses too (options.h).
            const datadist::OptionSpec &spec = *datadist::FindOption("datadist.Transport");
            datadist::ApplyTransport(datadist::CheckValue(spec, transport, spec.key).s, &o);
            py::gil_scoped_release nogil;
            datadist::tls::Files files{tls_cert, tls_key, tls_ca};
            if (!files.empty()) o.tls = datadist::tls::Context::Load(files);  // LLM_PARAM_INVALID naming a file
            c.engine().Open(o);
          },
          py::kw_only(), py::arg("secret"), py::arg("transport"), py::arg("allow_ptrace"), py::arg("max_conns"),
          py::arg("max_per_peer"), py::arg("tls_cert") = "", py::arg("tls_key") = "", py::arg("tls_ca") = "",
          py::arg("nixl_serve") = false, py::arg("nixl_whole_process") = false,
          "Starts the engine; `transport` is a parsed datadist.Transport (auto, tcp, cma, shm, nixl: "
          "options.h ApplyTransport says what each means for links; nixl: LLM_PARAM_INVALID when NIXL "
          "cannot be loaded); with the three TLS files (PEM), every connection runs mutual TLS; "
          "nixl_serve (and nixl_whole_process): serve NIXL readers.")
      .def(
          "set_local_comm_res",
          [](Core &c, bool set, const std::string &text) { c.engine().SetLocalCommRes(set, text); }, py::arg("set"),
          py::arg("text"), "After open: llm.LocalCommRes, checked when linking as CANN does (Engine::SetLocalCommRes).")
      .def(
          "close",
          [](Core &c, double wait_s) {
            py::gil_scoped_release nogil;
            return c.Close(wait_s);
          },
          py::arg("wait_s"),
          "Stop serving, close every link and drop every cache, waiting up to wait_s for leases; "
          "returns how many caches are still leased (their memory must stay mapped). Blocks.")
      .def_property(
          "role", [](Core &c) { return c.engine().role(); }, [](Core &c, int32_t r) { c.engine().set_role(r); })
      .def(
          "listen",
          [](Core &c, const std::string &host, uint16_t port) {
            py::gil_scoped_release nogil;
            c.engine().Listen(host, port);
            return c.engine().port();
          },
          py::arg("host"), py::arg("port"))
      .def("stop_listening",
           [](Core &c) {
             py::gil_scoped_release nogil;
             c.engine().StopListening();
           })
      .def_property_readonly("port", [](Core &c) { return c.engine().port(); })
      .def(
          "connect",
          [](Core &c, uint64_t id, const std::string &host, uint16_t port, double timeout_s, bool take_peer_id) {
            py::gil_scoped_release nogil;
            return c.engine().Connect(id, host, port, DeadlineIn(timeout_s), take_peer_id, true);
          },
          py::arg("cluster_id"), py::arg("host"), py::arg("port"), py::arg("timeout_s"), py::kw_only(),
          py::arg("take_peer_id"))
      .def(
          "unlink",
          [](Core &c, uint64_t id, double timeout_s, bool force, bool quiet_inbound) {
            py::gil_scoped_release nogil;
            c.Unlink(id, DeadlineIn(timeout_s), force, quiet_inbound);
          },
          py::arg("cluster_id"), py::arg("timeout_s"), py::kw_only(), py::arg("force"), py::arg("quiet_inbound"))
      .def(
          "link_many",
          [](Core &c, const std::vector<std::tuple<uint64_t, std::string, uint16_t>> &peers, double timeout_s,
             bool take_peer_id) {
            std::vector<datadist::Peer> ps;
            for (const auto &p : peers) ps.push_back({std::get<0>(p), std::get<1>(p), std::get<2>(p)});
            Deadline deadline = DeadlineIn(timeout_s);
            py::gil_scoped_release nogil;
            std::vector<std::tuple<uint32_t, uint64_t, std::string>> out;
            for (const auto &o : c.LinkMany(ps, deadline, take_peer_id)) out.emplace_back(o.code, o.filed, o.why);
            return out;
          },
          py::arg("peers"), py::arg("timeout_s"), py::arg("take_peer_id"),
          "Links to every (cluster_id, host, port) at once (Session::LinkMany), each within timeout_s; "
          "[(code, filed cluster id, why)] in order, code 0 on success. Blocks without the GIL.")
      .def(
          "unlink_many",
          [](Core &c, const std::vector<std::tuple<uint64_t, std::string, uint16_t>> &peers, double timeout_s,
             bool force, bool hixl) {
            std::vector<datadist::Peer> ps;
            for (const auto &p : peers) ps.push_back({std::get<0>(p), std::get<1>(p), std::get<2>(p)});
            datadist::UnlinkRule rule;
            rule.force = force;
            rule.hixl = hixl;
            Deadline deadline = DeadlineIn(timeout_s);
            py::gil_scoped_release nogil;
            std::vector<std::tuple<uint32_t, std::string>> out;
            for (const auto &o : c.UnlinkMany(ps, deadline, rule)) out.emplace_back(o.code, o.why);
            return out;
          },
          py::arg("peers"), py::arg("timeout_s"), py::kw_only(), py::arg("force"), py::arg("hixl"),
          "CANN's unlink of every (cluster_id, host, port) at once (Session::UnlinkMany; host \"\": none "
          "given); [(code, why)] in order, code 0 on success. Blocks without the GIL.")
      .def(
          "ping",
          [](Core &c, uint64_t id, double timeout_s) {
            auto link = c.engine().GetLink(id);
            py::gil_scoped_release nogil;
            link->Ping(DeadlineIn(timeout_s));
          },
          py::arg("cluster_id"), py::arg("timeout_s"))
      .def(
          "open_link",
          [](Core &c, uint64_t id, const std::string &host, uint16_t port, double timeout_s, bool take_peer_id,
             bool reverse) {
            py::gil_scoped_release nogil;
            return c.engine().OpenLink(id, host, port, DeadlineIn(timeout_s), take_peer_id, reverse);
          },
          py::arg("cluster_id"), py::arg("host"), py::arg("port"), py::arg("timeout_s"), py::kw_only(),
          py::arg("take_peer_id"), py::arg("reverse"))
      .def(
          "adopt_link", [](Core &c, const std::shared_ptr<datadist::Link> &link) { c.engine().AdoptLink(link); },
          py::arg("link"))
      .def(
          "listen_also",
          [](Core &c, const std::string &host, uint16_t port) {
            py::gil_scoped_release nogil;
            return c.engine().ListenAlso(host, port);
          },
          py::arg("host"), py::arg("port"))
      .def(
          "stop_also",
          [](Core &c, int key) {
            py::gil_scoped_release nogil;
            c.engine().StopAlso(key);
          },
          py::arg("key"))
      .def(
          "hello_count", [](Core &c, uint64_t id) { return c.engine().HelloCount(id); }, py::arg("cluster_id"))
      .def("inbound_control", [](Core &c) { return c.engine().InboundControl(); })
      // Both may close reverse channels their clients left (an I/O group stop): without the GIL.
      .def("has_links",
           [](Core &c) {
             py::gil_scoped_release nogil;
             return c.engine().HasLinks();
           })
      .def(
          "link_ids",
          [](Core &c, bool inbound) {
            py::gil_scoped_release nogil;
            return c.engine().LinkIds(inbound);
          },
          py::arg("inbound"))
      .def(
          "linked",
          [](Core &c, uint64_t id) -> py::typing::Tuple<bool, bool> {
            auto [own, inbound] = c.engine().BothEnds(id);
            return py::make_tuple(own != nullptr, inbound != nullptr);
          },
          py::arg("cluster_id"), "(we made a link to it, it made one to us)")
      .def(
          "link_serial",
          [](Core &c, uint64_t id) -> py::typing::Optional<py::int_> {
            auto link = c.engine().FindLink(id);
            if (!link) return py::none();
            return py::int_(link->serial());
          },
          py::arg("cluster_id"),
          "which link `cluster_id` is filed under now (Link::serial, never reused): tells a replaced link from "
          "the one seen before (tests)")
      .def(
          "link_path",
          [](Core &c, uint64_t id) -> py::typing::Optional<py::str> {
            auto link = c.engine().FindLink(id);
            if (!link) return py::none();
            return py::str(link->path_name());
          },
          py::arg("cluster_id"))
      .def(
          "link_moved",
          [](Core &c, uint64_t id) -> py::typing::Optional<py::str> {
            auto link = c.engine().FindLink(id);
            if (!link) return py::none();
            return py::str(link->last_moved());
          },
          py::arg("cluster_id"), "how the link's last pull moved its bytes: shm, cma, stream or \"\"")
      .def(
          "link_reason",
          [](Core &c, uint64_t id) -> py::typing::Optional<py::str> {
            auto link = c.engine().FindLink(id);
            if (!link) return py::none();
            return py::str(link->PathReason());
          },
          py::arg("cluster_id"), "why the link took its path")
      .def(
          "probe_cma",
          [](Core &c, uint64_t id, double timeout_s) {
            auto link = c.engine().FindLink(id);
            if (!link)
              datadist::Fail(llm_datadist::LLM_NOT_YET_LINK, "cluster " + std::to_string(id) + " is not linked");
            py::gil_scoped_release nogil;
            link->ProbeCma(DeadlineIn(timeout_s));
          },
          py::arg("cluster_id"), py::arg("timeout_s"),
          "on the cma path, ask the kernel now whether it lets us read the owner's memory; a refusal "
          "changes the link's path and reason as the first pull would (datadist info --peer)")
      .def(
          "last_link_failure", [](Core &c, uint64_t id) { return c.engine().LastLinkFailure(id); },
          py::arg("cluster_id"))
      // The caches: one registry, the core's (cpp/src/registry.h). NativeEngine files its caches
      // here and asks for what it plans with; calls that run the registry's hooks (a NIXL
      // registration, a CUDA query, revoking leases) or wait for leases release the GIL.
      .def(
          "add_cache",
          [](Core &c, uint32_t num_tensors, uint64_t tensor_bytes, uint64_t units, uint64_t layout,
             const U64Array &addrs, bool allocated, bool remote_accessible, bool blocks, bool device,
             const py::object &shm, const KeyList &keys, std::optional<uint64_t> model_id) {
            const datadist::Geometry g = GeometryOf(num_tensors, tensor_bytes, units, layout);
            datadist::CacheOptions o;
            o.allocated = allocated;
            o.remote_accessible = remote_accessible;
            o.blocks = blocks;
            o.device = device;
            datadist::ShmPlace place;
            if (!shm.is_none()) {  // (fds, inos, offsets): where each tensor lies in a sealed memfd of ours
              auto parts = shm.cast<std::tuple<std::vector<int32_t>, std::vector<uint64_t>, std::vector<uint64_t>>>();
              place.fds = std::move(std::get<0>(parts));
              place.inos = std::move(std::get<1>(parts));
              place.offsets = std::move(std::get<2>(parts));
            }
            std::vector<datadist::KeyId> ks;
            std::vector<uint64_t> slots;
            KeysOf(keys, &ks, &slots);
            const std::vector<uint64_t> bases = ToVector(addrs);
            py::gil_scoped_release nogil;
            return c.engine().registry().File(g, bases, o, place, ks, slots, model_id);
          },
          py::arg("num_tensors"), py::arg("tensor_bytes"), py::arg("units"), py::arg("layout"), py::arg("addrs"),
          py::kw_only(), py::arg("allocated"), py::arg("remote_accessible"), py::arg("blocks"), py::arg("device"),
          py::arg("shm") = py::none(), py::arg("keys") = KeyList(), py::arg("model_id") = py::none(),
          "Files a cache (its memory the caller's) under the next free id and returns it, with `keys` "
          "((value, model_id, is_prefix) or None per slot, from slot 0) and `model_id` (a BlocksCacheKey's) "
          "bound to it, all or nothing; `device`: DEVICE placement (NIXL registers it as VRAM where CUDA says "
          "its memory is a GPU's). InvalidArgument for bad keys or addresses. Blocks without the GIL while "
          "NIXL registers it.")
      .def(
          "check_keys",
          [](Core &c, const KeyList &keys, uint64_t units) {
            std::vector<datadist::KeyId> ks;
            std::vector<uint64_t> slots;
            KeysOf(keys, &ks, &slots);
            c.engine().registry().CheckKeys(ks, slots, units);
          },
          py::arg("keys"), py::arg("units"),
          "add_cache's key rules for a cache of `units` slots, checked before its memory is allocated "
          "(InvalidArgument). Never blocks.")
      .def(
          "key_bound",
          [](Core &c, uint64_t value, uint64_t model_id, bool is_prefix) {
            return c.engine().registry().Bound({value, model_id, is_prefix});
          },
          py::arg("value"), py::arg("model_id"), py::arg("is_prefix"),
          "Whether the key is bound to a cache now (false once a peer's read consumed it). Never blocks.")
      .def(
          "cache_info",
          [](Core &c, int64_t id) {
            const datadist::Registry::Info info = c.engine().registry().Describe(id);
            U64Array addrs(static_cast<py::ssize_t>(info.addrs.size()));
            std::copy(info.addrs.begin(), info.addrs.end(), addrs.mutable_data());
            return py::make_tuple(info.geo.num_tensors, info.geo.tensor_bytes, info.geo.units, info.opts.blocks,
                                  info.geo.layout, addrs, info.opts.allocated, info.opts.device,
                                  info.opts.remote_accessible, info.leases);
          },
          py::arg("cache_id"),
          "(num_tensors, tensor_bytes, units, blocks, layout, addrs, allocated, device, remote_accessible, leases) "
          "of a filed cache; CacheNotFound for an unknown (deallocated, unregistered) id. Never blocks.")
      .def(
          "cache_ids", [](Core &c) { return c.engine().registry().Ids(); }, "The ids filed now, ascending.")
      .def(
          "filed", [](Core &c, int64_t id) { return c.engine().registry().Filed(id); }, py::arg("cache_id"),
          "Whether a cache is filed under `cache_id` now (not deallocated, unregistered or being "
          "unregistered). Never blocks.")
      .def(
          "hold",
          [](py::object self, int64_t id) {
            std::unique_ptr<datadist::Lease> lease = self.cast<Core &>().engine().registry().Hold(id);
            return Hold{std::move(self), std::move(lease), id};
          },
          py::arg("cache_id"),
          "Holds a filed cache for a local transfer until the Hold's release(): unregistering waits for it. "
          "CacheNotFound for an unknown id or one being unregistered. Never blocks.")
      .def(
          "unbind_key",
          [](Core &c, uint64_t value, uint64_t model_id, bool is_prefix) {
            py::gil_scoped_release nogil;  // a cache it alone held is released (NIXL deregisters it)
            c.engine().registry().UnbindKey({value, model_id, is_prefix});
          },
          py::arg("value"), py::arg("model_id"), py::arg("is_prefix"))
      // ---- pools (pool.h): the registry carves pool caches and gives their pages back itself
      .def(
          "open_pool",
          [](Core &c, bool device, uint64_t memory_size, uint32_t page_shift) {
            auto pool = datadist::Pool::Create(device ? "datadist-device-pool" : "datadist-host-pool", memory_size,
                                               page_shift);
            c.engine().registry().SetPool(device, std::move(pool));
          },
          py::kw_only(), py::arg("device"), py::arg("memory_size"), py::arg("page_shift"),
          "The pool DEVICE (device=True) or HOST caches are allocated from (mem_pool_cfg, host_mem_pool_cfg): "
          "one sealed memfd of memory_size bytes in pages of 1 << page_shift. InvalidArgument for a bad size or "
          "page_shift, OutOfMemory when it cannot be mapped. Never blocks.")
      .def(
          "pool_info",
          [](Core &c, bool device) -> py::typing::Optional<py::typing::Tuple<uint64_t, uint64_t, uint64_t>> {
            auto pool = c.engine().registry().PoolOf(device);
            if (!pool) return py::none();
            return py::make_tuple(pool->size(), pool->used(), pool->page());
          },
          py::kw_only(), py::arg("device"),
          "(size, used, page) of the DEVICE or HOST pool in bytes; None without one (or after close). Never "
          "blocks.")
      .def(
          "allocate",
          [](Core &c, uint32_t num_tensors, uint64_t tensor_bytes, uint64_t units, uint64_t layout, bool blocks,
             bool device, const KeyList &keys, std::optional<uint64_t> model_id) {
            const datadist::Geometry g = GeometryOf(num_tensors, tensor_bytes, units, layout);
            datadist::CacheOptions o;
            o.blocks = blocks;
            std::vector<datadist::KeyId> ks;
            std::vector<uint64_t> slots;
            KeysOf(keys, &ks, &slots);
            py::gil_scoped_release nogil;  // NIXL registers it; a released cache is deregistered
            return c.engine().registry().Allocate(device, g, o, ks, slots, model_id);
          },
          py::arg("num_tensors"), py::arg("tensor_bytes"), py::arg("units"), py::arg("layout"), py::kw_only(),
          py::arg("blocks"), py::arg("device"), py::arg("keys") = KeyList(), py::arg("model_id") = py::none(),
          "allocate_cache / allocate_blocks_cache: carves the tensors (each on a page) from the pool of the "
          "placement and files them as add_cache files a cache (keys, model_id), all or nothing; returns its id. "
          "Deallocated pool caches nothing holds any more are released first. InvalidArgument without a pool or "
          "for bad keys, OutOfMemory when the pool has no room. Blocks without the GIL while NIXL registers it.")
      .def(
          "set_model_map", [](Core &c, bool on) { c.engine().registry().SetModelMap(on); }, py::arg("on"))
      .def(
          "set_remote_writes", [](Core &c, bool on) { c.engine().registry().SetRemoteWrites(on); }, py::arg("allowed"))
      .def(
          "bind_model",
          [](Core &c, uint64_t model_id, int64_t id) {
            py::gil_scoped_release nogil;  // revokes the leases through it on the cache it named
            c.engine().registry().BindModel(model_id, id);
          },
          py::arg("model_id"), py::arg("cache_id"))
      .def(
          "unbind_model",
          [](Core &c, uint64_t model_id) {
            py::gil_scoped_release nogil;
            c.engine().registry().UnbindModel(model_id);
          },
          py::arg("model_id"))
      .def(
          "deallocate",
          [](Core &c, int64_t id, bool drop_keys) {
            py::gil_scoped_release nogil;  // revokes its whole-cache leases; NIXL deregisters it
            c.engine().registry().Deallocate(id, drop_keys);
          },
          py::arg("cache_id"), py::arg("drop_keys"))
      .def(
          "caches_in_use",
          [](Core &c, double wait_s) {
            py::gil_scoped_release nogil;
            return c.engine().registry().AwaitStuck(wait_s);
          },
          py::arg("wait_s"),
          "After close: waits up to wait_s for the caches a transfer still held when they were dropped; "
          "returns how many still are (their memory must stay mapped).")
      .def(
          "remove_cache",
          [](Core &c, int64_t id, double wait_s) {
            py::gil_scoped_release nogil;
            c.engine().registry().Remove(id, false, wait_s);
          },
          py::arg("cache_id"), py::arg("wait_s"))
      // ---- local copies: one core call per copy_cache / copy_blocks / swap_blocks, planned by
      // the session (Session::CopySlot / CopyBlocks, the C++ face's too). The GIL is let go
      // once the plan passed, before a copy of over kHoldBytes (gil.h), and taken back after.
      .def(
          "copy_slot",
          [](Core &c, const CopySideArg &src, const CopySideArg &dst, uint64_t src_unit, uint64_t dst_unit,
             uint64_t offset, int64_t size) {
            const datadist::CopySide s = ToCopySide(src), d = ToCopySide(dst);
            std::optional<datadist_py::GilHold> hold;
            return c.CopySlot(s, d, src_unit, dst_unit, offset, size, [&](uint64_t bytes) { hold.emplace(bytes); });
          },
          py::kw_only(), py::arg("src"), py::arg("dst"), py::arg("src_unit"), py::arg("dst_unit"), py::arg("offset"),
          py::arg("size"),
          "Copies slot src_unit of every tensor of `src` into slot dst_unit of the same tensor of `dst` (a filed "
          "cache's id, or a UserCache): `size` bytes from `offset` in the slot on both sides (-1: the rest of the "
          "source slot). Planned, held and checked by the core (Session::CopySlot, PlanSlotCopy: InvalidArgument "
          "with the Python API's texts; CacheNotFound when a cache is not filed). Returns the bytes copied. Over "
          "1 MiB, copies without the GIL.")
      .def(
          "copy_blocks",
          [](Core &c, const CopySideArg &src, const CopySideArg &dst, const U64Array &src_blocks,
             const U64Array &dst_blocks) {
            const datadist::CopySide s = ToCopySide(src), d = ToCopySide(dst);
            const std::vector<uint64_t> from = ToVector(src_blocks), to = ToVector(dst_blocks);
            std::optional<datadist_py::GilHold> hold;
            return c.CopyBlocks(s, d, from, to, [&](uint64_t bytes) { hold.emplace(bytes); });
          },
          py::kw_only(), py::arg("src"), py::arg("dst"), py::arg("src_blocks"), py::arg("dst_blocks"),
          "Copies block src_blocks[i] of every tensor of `src` into block dst_blocks[i] of the same tensor of "
          "`dst` (a filed cache's id, or a UserCache), runs adjacent on both sides as one copy. Planned, held and "
          "checked by the core (Session::CopyBlocks, PlanBlockCopy: InvalidArgument with the Python API's texts, "
          "a destination named twice and, within one cache, a block both read and written included; "
          "CacheNotFound when a cache is not filed). Returns the bytes copied. Over 1 MiB, copies without the "
          "GIL.")
      .def(
          "prepare",
          [](Core &c, bool write, uint64_t cluster, uint8_t kind, uint64_t a, uint64_t b, uint64_t cc,
             uint64_t unit_bytes, uint32_t flags, int64_t cache_id, const U32Array &remote_tensors,
             const U64Array &remote_offsets, const U64Array &lengths, const U32Array &local_tensors,
             const U64Array &local_offsets) {
            datadist::wire::Request req = KeyRequest(kind, a, b, cc);
            req.unit_bytes = unit_bytes;
            req.flags = flags;
            datadist::Plan plan;  // copied: the arrays are Python's
            plan.remote_tensors.assign(remote_tensors.data(), remote_tensors.data() + remote_tensors.size());
            plan.local_tensors.assign(local_tensors.data(), local_tensors.data() + local_tensors.size());
            plan.remote_offsets = ToVector(remote_offsets);
            plan.local_offsets = ToVector(local_offsets);
            plan.lengths = ToVector(lengths);
            return c.Prepare(write, cluster, std::move(req), plan, cache_id);
          },
          py::kw_only(), py::arg("write"), py::arg("cluster_id"), py::arg("kind"), py::arg("a"), py::arg("b"),
          py::arg("c"), py::arg("unit_bytes"), py::arg("flags"), py::arg("cache_id"), py::arg("remote_tensors"),
          py::arg("remote_offsets"), py::arg("lengths"), py::arg("local_tensors"), py::arg("local_offsets"),
          "A READ (write=False) or WRITE of the plan's spans into (from) local cache `cache_id`, made ready "
          "to run (run, submit): the core checks every local span against that cache's geometry "
          "(InvalidArgument) and makes the local spans from its registry's addresses; the layout stated is "
          "the cache's. CacheNotFound for an unknown cache. Never blocks.")
      .def(
          "prepare_pull",
          [](Core &c, uint64_t cluster, uint8_t key_kind, uint64_t a, uint64_t b, uint64_t cc, bool checksum,
             int64_t cache_id, uint8_t kind, uint64_t batch_index, int64_t size, uint64_t src_offset,
             uint64_t dst_offset, const BlockIds &src_blocks, const BlockIds &dst_blocks,
             std::optional<std::pair<uint64_t, uint64_t>> src_layers,
             std::optional<std::pair<uint64_t, uint64_t>> dst_layers, int64_t tensor_num_per_layer) {
            if (kind > datadist::PullSpec::kSlotToBlocks) datadist::Invalid("unknown pull kind " + std::to_string(kind));
            datadist::wire::Request req = KeyRequest(key_kind, a, b, cc);
            if (checksum) req.flags |= datadist::wire::kFlagChecksum;
            datadist::PullSpec spec;
            spec.kind = static_cast<datadist::PullSpec::Kind>(kind);
            spec.batch_index = batch_index;
            spec.size = size;
            spec.src_offset = src_offset;
            spec.dst_offset = dst_offset;
            spec.src_blocks = src_blocks.view;
            spec.dst_blocks = dst_blocks.view;
            if (src_layers) spec.src_layers = {true, src_layers->first, src_layers->second};
            if (dst_layers) spec.dst_layers = {true, dst_layers->first, dst_layers->second};
            spec.tensor_num_per_layer = tensor_num_per_layer;
            return c.PreparePull(cluster, std::move(req), spec, cache_id);
          },
          py::arg("cluster_id"), py::arg("key_kind"), py::arg("a"), py::arg("b"), py::arg("c"), py::arg("checksum"),
          py::arg("cache_id"), py::arg("kind"), py::arg("batch_index"), py::arg("size"), py::arg("src_offset"),
          py::arg("dst_offset"), py::arg("src_blocks"), py::arg("dst_blocks"), py::arg("src_layers"),
          py::arg("dst_layers"), py::arg("tensor_num_per_layer"),
          "The Python face's pull, planned, checked and made ready to run (run, submit) in one call "
          "(Session::PreparePull): local cache `cache_id` held (CacheNotFound), the pull planned against its "
          "geometry with the Python API's rules and texts (InvalidArgument: kind 0 a slot, `batch_index`, "
          "`size` (-1: the rest), `src_offset` / `dst_offset` in it; 1 blocks `src_blocks` into `dst_blocks`; "
          "2 the remote slot split into `dst_blocks`; half-open layer ranges, None for none), the request's "
          "size and every local span checked. `key_kind`, `a`, `b`, `c` name the remote cache; `checksum` "
          "asks the owner for a CRC-32. Never blocks; positional for speed (every pull passes here).")
      .def(
          "prepare_push",
          [](Core &c, uint64_t cluster, uint8_t key_kind, uint64_t a, uint64_t b, uint64_t cc, int64_t cache_id,
             bool blocks, uint64_t batch_index, int64_t size, const BlockIds &src_blocks, const BlockIds &dst_blocks,
             uint64_t remote_first, uint64_t local_first, uint64_t count) {
            datadist::PushSpec spec;
            spec.blocks = blocks;
            spec.batch_index = batch_index;
            spec.size = size;
            spec.src_blocks = src_blocks.view;
            spec.dst_blocks = dst_blocks.view;
            spec.remote_first = remote_first;
            spec.local_first = local_first;
            spec.count = count;
            return c.PreparePush(cluster, KeyRequest(key_kind, a, b, cc), spec, cache_id);
          },
          py::arg("cluster_id"), py::arg("key_kind"), py::arg("a"), py::arg("b"), py::arg("c"), py::arg("cache_id"),
          py::arg("blocks"), py::arg("batch_index"), py::arg("size"), py::arg("src_blocks"), py::arg("dst_blocks"),
          py::arg("remote_first"), py::arg("local_first"), py::arg("count"),
          "The Python face's push, planned, checked and made ready to run in one call (Session::PreparePush): "
          "local cache `cache_id` held (CacheNotFound), remote tensor remote_first + i <- local tensor "
          "local_first + i for i < count, then local slot `batch_index` (`size` bytes, -1: all) or local "
          "blocks `src_blocks` into remote blocks `dst_blocks` (InvalidArgument with the Python API's texts), "
          "the request's size and every local span checked. Never blocks; positional for speed.")
      .def(
          "prepare_layer_pushes",
          [](Core &c, uint64_t cluster, uint8_t key_kind, uint64_t a, uint64_t b, uint64_t cc, uint64_t unit_bytes,
             int64_t cache_id, uint8_t kind, uint64_t src_unit, const BlockIds &src_blocks, const BlockIds &dst_blocks,
             uint64_t dst_block_bytes, uint64_t src_first, uint64_t dst_first, uint64_t layers,
             uint64_t tensors_per_layer, const U64Array &dst_addrs) {
            if (kind > datadist::LayerPushSpec::kSlotToBlocks)
              datadist::Invalid("unknown layer push kind " + std::to_string(kind));
            datadist::wire::Request req = KeyRequest(key_kind, a, b, cc);
            req.unit_bytes = unit_bytes;
            datadist::LayerPushSpec spec;
            spec.kind = static_cast<datadist::LayerPushSpec::Kind>(kind);
            spec.src_unit = src_unit;
            spec.src_blocks = src_blocks.view;
            spec.dst_blocks = dst_blocks.view;
            spec.dst_block_bytes = dst_block_bytes;
            spec.src_first = src_first;
            spec.dst_first = dst_first;
            spec.layers = layers;
            spec.tensors_per_layer = tensors_per_layer;
            spec.dst_addrs = ToVector(dst_addrs);
            return c.PrepareLayerPushes(cluster, req, spec, cache_id);
          },
          py::kw_only(), py::arg("cluster_id"), py::arg("key_kind"), py::arg("a"), py::arg("b"), py::arg("c"),
          py::arg("unit_bytes"), py::arg("cache_id"), py::arg("kind"), py::arg("src_unit"), py::arg("src_blocks"),
          py::arg("dst_blocks"), py::arg("dst_block_bytes"), py::arg("src_first"), py::arg("dst_first"),
          py::arg("layers"), py::arg("tensors_per_layer"), py::arg("dst_addrs"),
          "transfer_cache_async's pushes of one destination, every layer's, planned, checked and made ready to "
          "run in one call (Session::PrepareLayerPushes): local cache `cache_id` held (CacheNotFound), one "
          "layer's spans planned against its view with the Python API's texts (InvalidArgument: kind 0 slot "
          "`src_unit`, 1 blocks `src_blocks` into `dst_blocks` (`dst_block_bytes` apart, 0: a source block), 2 "
          "slot `src_unit` cut into `dst_block_bytes` chunks into `dst_blocks`), source layers src_first + k "
          "into destination layers dst_first + k for k < `layers`; by key (`dst_addrs` empty) one call per "
          "layer, by raw address one per tensor of each layer (layer-major), every address plus every span "
          "checked below 2**64 first. `key_kind`, `a`, `b`, `c`, `unit_bytes` name the destination. Never "
          "blocks.")
      .def(
          "run",
          [](Core &c, const Call &call, double timeout_s) { datadist_py::RunHeld(c, call, timeout_s); },
          py::arg("call"), py::arg("timeout_s"),
          "Runs a prepared transfer until it ends or timeout_s passes, its local cache held by the core "
          "for the transfer (CacheNotFound, counted, when it is gone); the GIL is released where it waits.")
      .def(
          "submit",
          [](Core &c, std::shared_ptr<Call> call, double timeout_s) {
            // The deadline runs from now, as a blocking call's would; queueing counts (in the
            // metrics too: the transfer is timed from here).
            const auto since = datadist::Clock::now();
            Deadline deadline = DeadlineIn(timeout_s);
            // A small pull may end inline under a lease (Session::Submit): that copy waits for
            // nobody, so it keeps the GIL (gil.h); anything else gives it up at once.
            datadist_py::GilHold hold(call->write || call->bytes > datadist::kInlineBytes ? ~uint64_t{0} : call->bytes);
            return c.Submit(std::move(call), deadline, since);
          },
          py::arg("call"), py::arg("timeout_s"),
          "Queues a prepared transfer on the engine's workers; returns its Handle at once. The core holds "
          "the call's local cache from now until the transfer ends (CacheNotFound, counted, when it is gone: "
          "nothing is queued), so unregistering it waits for the transfer.")
      .def("layers", &Core::Layers, py::arg("jobs"), py::arg("steps"), py::arg("width"), py::arg("step_timeout_s"),
           py::keep_alive<0, 1>(),
           "A layer-wise run of `steps` steps for `jobs` destinations (LayerRun), up to `width` steps at once, each "
           "within step_timeout_s of its start; "
           "the run keeps the engine alive. Never blocks.")
      .def_property_readonly("async_threads", [](Core &c) { return c.executor().threads(); })
      .def(
          "peer_stats",
          [](Core &c, uint64_t id, double timeout_s) {
            std::string json;
            {
              py::gil_scoped_release nogil;
              json = c.engine().PeerStats(id, DeadlineIn(timeout_s));
            }
            return py::bytes(json);
          },
          py::arg("cluster_id"), py::arg("timeout_s"),
          "The linked peer's metrics (STATS_REQUEST): its JSON bytes. Blocks without the GIL up to timeout_s.");

  // The process's transfer metrics, kept by the core (cpp/src/metrics.h): every engine of the
  // process records there. Called by datadist.core.metrics at any time; never blocks.
  m.def("metrics_series", &MetricsSeries,
        "Every series with a transfer: (op, cluster_id, transfers, bytes, {status name: count}, "
        "bucket counts, nanoseconds).");
  m.def(
      "metrics_reset", [] { datadist::metrics::Reset(); }, "Zeroes every counter (tests).");
  m.def(
      "metrics_record",
      [](const std::string &op, uint64_t cluster, uint64_t nbytes, double seconds, uint64_t code) {
        namespace metrics = datadist::metrics;
        for (size_t i = 0; i < metrics::kOps; ++i)
          if (op == metrics::OpName(static_cast<metrics::Op>(i))) {
            const auto took = std::chrono::duration_cast<datadist::Clock::duration>(
                std::chrono::duration<double>(seconds < 0 ? 0 : seconds));
            metrics::Record(static_cast<metrics::Op>(i), cluster, nbytes, took, static_cast<datadist::Status>(code));
            return;
          }
        throw py::value_error("unknown operation '" + op + "'");
      },
      py::arg("op"), py::arg("cluster_id"), py::arg("nbytes"), py::arg("seconds"), py::arg("code"),
      "Counts one transfer the core did not run (code 0: succeeded), e.g. one refused before it reached the core.");

  // The planned pulls of the Python face (planned.h): after Engine, their first argument.
  datadist_py::BindPlanned(m);
  // The hooks for tests and tools (testing.h), in their own submodule: after Engine is bound.
  datadist::python::BindTesting<Core>(m);
}

// datadist._core.testing: the binding's hooks for tests and tools, kept out of the production
// module's classes. Each function takes the Engine it looks into (or changes) as its first
// argument; nothing in src/datadist outside datadist.testing calls them.
//
// Who calls: datadist.testing.engine (the tests' helpers), the NIXL example's GPU check, the
// option-table test. Every function returns at once except nixl_progress, which runs one
// progress call of NIXL's agent without the GIL.
//
// A template over the binding's engine class (the type `Engine` is bound to: it has
// `datadist::Engine &engine()`), instantiated once at the end of PYBIND11_MODULE, after that
// class is registered, so that the stub names its parameters `Engine`.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "engine.h"
#include "link.h"
#include "nixl.h"
#include "options.h"

namespace datadist::python {

template <class Core>
void BindTesting(pybind11::module_ &parent) {
  namespace py = pybind11;
  py::module_ m = parent.def_submodule(
      "testing", "Hooks into an Engine for tests and tools (datadist.testing.engine); not for production code.");
  // Importable by its name too (`import datadist._core.testing`), as its stub says it is.
  py::module_::import("sys").attr("modules")[m.attr("__name__")] = m;

  m.def(
      "nixl_agent",
      [](Core &c) -> std::optional<std::tuple<std::string, uint64_t, size_t, size_t, uint64_t>> {
        std::shared_ptr<nixl::Agent> a = c.engine().nixl_owner().agent();
        if (!a) return std::nullopt;
        return std::make_tuple(a->name(), a->generation(), a->pump_users(), a->pump_fresh(), a->prepared());
      },
      py::arg("engine"),
      "(name, generation, leases keeping its pump beating, of them on connections without a completed NIXL "
      "read, transfers prepared so far) of the engine's NIXL agent, or None before one was needed.");
  m.def(
      "nixl_regions",
      [](Core &c) {
        std::vector<std::tuple<uint64_t, uint64_t, int, int>> out;
        if (std::shared_ptr<nixl::Agent> a = c.engine().nixl_owner().agent())
          for (const auto &s : a->Spans())
            out.emplace_back(s.start, s.end, static_cast<int>(s.kind.mem), static_cast<int>(s.kind.device));
        return out;
      },
      py::arg("engine"),
      "Every tensor the engine's NIXL agent registered: (start, end, memory kind: 0 DRAM, 1 VRAM, CUDA "
      "device), by address; empty before an agent was made.");
  m.def(
      "nixl_refusal", [](Core &c) { return c.engine().nixl_owner().Refusal(); }, py::arg("engine"),
      "Why the engine serves no NIXL reader (\"\": it does).");
  m.def(
      "nixl_leases", [](Core &c) -> size_t { return c.engine().nixl_owner().leases(); }, py::arg("engine"),
      "NIXL cache leases readers hold on the engine's caches now.");
  m.def(
      "link_nixl_leases",
      [](Core &c, uint64_t cluster_id) -> size_t {
        auto link = c.engine().FindLink(cluster_id);
        return link ? link->nixl_leases() : 0;
      },
      py::arg("engine"), py::arg("cluster_id"), "NIXL leases on whole caches the link to `cluster_id` holds now.");
  m.def(
      "set_nixl_options",
      [](Core &c, bool serve, bool whole_process) {
        nixl::ServeOptions o;
        o.serve = serve;
        o.whole_process = whole_process;
        c.engine().nixl_owner().SetOptions(o);
      },
      py::arg("engine"), py::kw_only(), py::arg("serve"), py::arg("whole_process"),
      "Serving NIXL turned on or off on a running engine (asked anew on every NIXL request).");
  m.def(
      "set_nixl_revoke_wait", [](Core &c, double seconds) { c.engine().nixl_owner().SetRevokeWait(seconds); },
      py::arg("engine"), py::arg("seconds"), "How long a reader has to give a revoked NIXL lease back (5 s).");
  m.def(
      "nixl_progress",
      [](Core &c) {
        std::shared_ptr<nixl::Agent> a = c.engine().nixl_owner().agent();
        py::gil_scoped_release nogil;
        if (a) a->Progress();
      },
      py::arg("engine"), "One progress call of the owner's NIXL agent, if made (driven while no lease is open).");

  m.def(
      "transport_settings",
      [](const std::string &transport) {
        EngineOptions o;
        const OptionSpec &spec = *FindOption("datadist.Transport");
        ApplyTransport(CheckValue(spec, transport, spec.key).s, &o);
        return std::map<std::string, bool>{
            {"local_channel", o.same_host}, {"shm", o.shm}, {"shm_forced", o.shm_forced}, {"nixl_read", o.nixl.read}};
      },
      py::arg("transport"),
      "What a forced transport means for links (options.h ApplyTransport): local_channel (used and served), "
      "shm, shm_forced, nixl_read.");
}

}  // namespace datadist::python

// datadist._core: the Python package's native core (a placeholder until the binding of the
// C++ engine lands). Built by the repository's top-level CMakeLists.txt from every
// cpp/python/*.cc, linked with datadist_core; imported lazily by datadist.core.native_build.
#include <pybind11/pybind11.h>

#include <string>

#include "wire.h"

namespace py = pybind11;

#ifndef DATADIST_VERSION
#error "DATADIST_VERSION is defined by the top-level CMakeLists.txt"
#endif

PYBIND11_MODULE(_core, m) {
  m.doc() = "datadist's native core (private: use the datadist package)";
  m.attr("__version__") = DATADIST_VERSION;
  // How this module was built, for `datadist info` and bug reports. Called by Python at any
  // time; returns at once.
  m.def("build_info", [] {
    py::dict info;
    info["compiler"] = DATADIST_CXX_COMPILER;
    info["build_type"] = DATADIST_BUILD_TYPE;
    info["pybind11"] = DATADIST_PYBIND11_VERSION;
    // The protocol version as datadist_core's codec writes it (byte 2 of a frame's header):
    // a call into the linked core.
    info["protocol"] = std::to_string(datadist::wire::EncodeEmpty(datadist::wire::kOk, 0).at(2));
    return info;
  }, "A dict: compiler, build_type, pybind11 (what it was built with), protocol (the core's wire version).");
}

"""Whether datadist's native core, the extension module ``datadist._core``, is built here.

``datadist._core`` is the pybind11 module over cpp/'s engine that the package's own build
makes (``pip install -e .`` into src/datadist/, ``pip install .`` into the wheel;
docs/native-build.md). ``import datadist`` never imports it, so a checkout on PYTHONPATH with
nothing built imports and runs as before: whoever needs the core imports ``datadist._core``
when it first needs it. ``datadist info`` reports :func:`native_available` and
:func:`build_info`; the tests require the module unless DATADIST_ALLOW_NO_CORE=1.
"""

from __future__ import annotations

MODULE = "datadist._core"
HOW_TO_BUILD = "pip install -e . builds it; docs/native-build.md"


def native_available() -> tuple[bool, str]:
    """``(True, "datadist._core VERSION (PATH)")`` when the module imports, else ``(False,
    why)``: not built, or built but not loadable here (another Python, a missing symbol).

    Called by ``datadist info``, the tests, and ``LLMDataDist.init`` (no core, no engine).
    Imports the module on the first call (loads its shared object; no
    threads, no sockets) and raises nothing but what that import raises beyond ImportError.
    """
    try:
        import datadist._core as _core
    except ModuleNotFoundError as e:
        if e.name != MODULE:  # the module exists but something it imports does not
            return False, f"{MODULE} does not load: {e}"
        return False, f"{MODULE} is not built ({HOW_TO_BUILD})"
    except ImportError as e:
        return False, f"{MODULE} does not load: {e} (rebuild it: {HOW_TO_BUILD})"
    return True, f"{MODULE} {_core.__version__} ({_core.__file__})"


def build_info() -> dict[str, str]:
    """How the built module was built: ``compiler`` ("GNU 12.2.0"), ``build_type``
    ("Release"), ``pybind11`` (its version), and ``protocol``, the wire protocol version its
    C++ core writes ("1"). Called by ``datadist info``; returns at once.
    Raises ImportError when the module is not built (:func:`native_available` says why)."""
    import datadist._core as _core

    return dict(_core.build_info())

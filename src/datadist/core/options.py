"""The core's option table (cpp/src/options.h) from Python: its rows, its parser, its check.

The init options both APIs take (``datadist.*``, ``llm.SyncKvCacheWaitTime``), their
environment variables, kinds, ranges, defaults and messages are one table in the core, read
by one parser that the C++ API's ``Initialize`` calls too. Who calls: ``LLMDataDist.init``
(:func:`parse_options`), ``LLMConfig``'s generated extras (:func:`option_table`,
:func:`check_option`), ``datadist info``, the engine. Every call returns at once; none opens a
socket. Errors: InvalidArgument (LLM_PARAM_INVALID) with the table's message; NotSupported
where the core is not built.
"""

from __future__ import annotations

from dataclasses import dataclass

from datadist.core import native_build
from datadist.core.errors import NotSupported


@dataclass(frozen=True)
class OptionSpec:
    """One row of the core's option table (cpp/src/options.h), as ``_core.options()`` gives
    it: the option key, its environment variable ("" for none), its kind ("bool", "int",
    "enum", "str", "path", "secret"), the accepted values (enum) or range (int, both ends
    included) and unit, the default as text, the LLMConfig property generated for it ("" for
    none) and its documentation."""

    key: str
    env: str
    kind: str
    values: tuple[str, ...]
    range: tuple[int, int] | None
    unit: str
    default: str
    attr: str
    doc: str


OptionValue = bool | int | str


def _need_core() -> None:
    """NotSupported unless the core loads; its callers then import it (``from datadist import
    _core``), so that mypy reads its stub."""
    ok, why = native_build.native_available()
    if not ok:
        raise NotSupported(f"datadist's native core is not available: {why}")


def option_table() -> tuple[OptionSpec, ...]:
    """Every row of the core's option table, in its order; () where the core is not built
    (LLMConfig then has no datadist extras, and init says why it cannot run). Returns at
    once (read from the core once)."""
    global _option_table
    if _option_table is None:
        if not native_build.native_available()[0]:
            return ()
        _need_core()
        from datadist import _core as mod

        _option_table = tuple(
            OptionSpec(str(r.key), str(r.env), str(r.kind), tuple(str(v) for v in r.values),
                       None if r.range is None else (int(r.range[0]), int(r.range[1])),
                       str(r.unit), str(r.default), str(r.attr), str(r.doc))
            for r in mod.options())
    return _option_table


_option_table: tuple[OptionSpec, ...] | None = None


def parse_options(options: dict[str, str], *, environ: bool = True
                  ) -> dict[str, tuple[OptionValue, str]]:
    """The core's one parser (the C++ API's Initialize runs the same): ``{key: (value,
    source)}`` for every row of the table, from ``options`` first, then (``environ``) the
    process's environment, then the default; source is "option", "env" or "default".
    InvalidArgument with the table's message for a bad value; NotSupported where the core
    is not built. Who calls: ``LLMDataDist.init``, ``datadist info``. Returns at once."""
    _need_core()
    from datadist import _core as mod

    parsed = mod.parse_options({str(k): str(v) for k, v in options.items()}, environ=environ)
    return {str(k): (v[0], str(v[1])) for k, v in parsed.items()}


def check_option(key: str, value: str) -> OptionValue:
    """One value of ``key`` checked alone by the core's table (LLMConfig's setters): its
    parsed value, or InvalidArgument with the table's message. Returns at once."""
    _need_core()
    from datadist import _core as mod

    return mod.check_option(key, value)

"""The core's option table from the Python face (cpp/src/options.h, issue 36).

Every case of tests/vectors/options.txt, the file cpp/tests/options_test.cc runs through the
C++ API, runs here through the core's parser (``_core.parse_options``, what ``init`` calls)
and, for "init" rows, through ``LLMDataDist.init`` itself: same values, same code, same
message. Among them the five places the two APIs disagreed (docs/compatibility.md,
"Options"). Then: LLMConfig's extras are the table's rows, checked by the table.

Before the table (50b45c0), run there: ``datadist.VerifyChecksum = "yes"`` was accepted by
Python's init with checksums off (verify_yes fails), and Python's messages were its own
(nixl_serve_true, caps_above_range fail on the text); the C++ API accepted a 9-digit cap and
"true" and ignored DATADIST_ALLOW_PTRACE (read from its code: it had no shared parser to run).
"""

from __future__ import annotations

import pathlib
import subprocess
from dataclasses import dataclass

import pytest

from datadist import LLMConfig, LLMDataDist, LLMException, LLMRole, LLMStatusCode
from datadist.core import native
from datadist.core import options as core_options
from datadist.core.errors import InvalidArgument

ROOT = pathlib.Path(__file__).resolve().parents[2]
VECTORS = ROOT / "tests" / "vectors" / "options.txt"

core = native.core_module()
pytestmark = pytest.mark.skipif(core is None, reason="the native core is not built")


@dataclass(frozen=True)
class Case:
    name: str
    options: dict[str, str]
    env: dict[str, str]
    init: bool
    expect: str
    line: int


def _pairs(field: str) -> dict[str, str]:
    field = field.strip()
    if field == "-":
        return {}
    out = {}
    for pair in field.split(";"):
        key, _, value = pair.partition("=")
        out[key] = value
    return out


def _cases() -> list[Case]:
    cases = []
    for n, line in enumerate(VECTORS.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        f = line.split(" | ")
        assert len(f) == 5, f"options.txt line {n}: {line!r}"
        cases.append(Case(f[0].strip(), _pairs(f[1]), _pairs(f[2]), f[3].strip() == "init",
                          f[4], n))
    return cases


CASES = _cases()


def test_the_file_has_every_disagreement() -> None:
    names = {c.name for c in CASES}
    for name in ("transport_nixl_no_local_channel", "caps_above_range", "caps_nine_digits",
                 "nixl_serve_true", "verify_yes", "verify_env_yes", "ptrace_env_off"):
        assert name in names


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch):
    """Unsets every variable of the table, then sets the case's."""
    for spec in core_options.option_table():
        if spec.env:
            monkeypatch.delenv(spec.env, raising=False)

    def put(env: dict[str, str]) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return put


def _text(value: bool | int | str) -> str:
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


# How an engine's config shows what the table parsed (keys without a field are checked by
# the parser only).
CONFIG = {
    "datadist.Transport": lambda c: c.transport,
    "datadist.VerifyChecksum": lambda c: _text(c.verify),
    "datadist.AllowPtrace": lambda c: _text(c.allow_ptrace),
    "datadist.MaxConnections": lambda c: str(c.max_connections),
    "datadist.MaxConnectionsPerPeer": lambda c: str(c.max_connections_per_peer),
    "datadist.NixlServe": lambda c: _text(c.nixl_serve),
    "datadist.AuthSecret": lambda c: (c.secret or b"").decode(),
    "llm.SyncKvCacheWaitTime": lambda c: str(round(c.sync_timeout * 1000)),
    "local_channel": lambda c: _text(core.testing.transport_settings(c.transport)["local_channel"]),
}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(case: Case, environ) -> None:
    environ(case.env)
    ok = case.expect.startswith("ok")
    expected = _pairs(case.expect[3:] or "-") if ok else {}
    # the parser init calls
    if ok:
        parsed = core_options.parse_options(case.options)
        for key, want in expected.items():
            if key == "local_channel":
                transport = str(parsed["datadist.Transport"][0])
                got = _text(core.testing.transport_settings(transport)["local_channel"])
            else:
                got = _text(parsed[key][0])
            assert got == want, key
    else:
        message = case.expect.removeprefix("invalid ")
        with pytest.raises(InvalidArgument) as e:
            core_options.parse_options(case.options)
        assert str(e.value) == message
    if not case.init:
        return
    # the Python API: LLMDataDist.init with the same options and environment
    dd = LLMDataDist(LLMRole.DECODER, 7)
    options = {"llm.EnableCacheManager": "1", **case.options}
    if ok:
        dd.init(options)
        try:
            for key, want in expected.items():
                if key in CONFIG:
                    assert CONFIG[key](dd.engine.config) == want, key
        finally:
            dd.finalize()
    else:
        with pytest.raises(LLMException) as raised:
            dd.init(options)
        assert raised.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
        assert str(raised.value) == case.expect.removeprefix("invalid ")


# ------------------------------------------------------------------ LLMConfig from the table


def test_llmconfig_extras_are_the_table_rows() -> None:
    rows = [s for s in core_options.option_table() if s.attr]
    assert {s.attr for s in rows} >= {"transport", "verify_checksum", "allow_ptrace",
                                      "max_connections", "nixl_serve", "auth_secret"}
    for spec in rows:
        prop = vars(LLMConfig)[spec.attr]
        assert isinstance(prop, property)
        assert spec.key in (prop.__doc__ or "") and spec.env in (prop.__doc__ or "")
        # the getter's default is the table's
        assert _text(getattr(LLMConfig(), spec.attr)) == spec.default


@pytest.mark.parametrize(("attr", "value", "message"), [
    ("max_connections", 70000, "datadist.MaxConnections must be an integer in [1, 65535], "
                               "got '70000'"),
    ("max_connections_per_peer", 0, "datadist.MaxConnectionsPerPeer must be an integer in "
                                    "[1, 65535], got '0'"),
    ("transport", "rdma", "unknown transport 'rdma' in datadist.Transport; use auto, tcp, "
                          "cma, shm or nixl"),
])
def test_llmconfig_setters_refuse_with_the_table_message(attr: str, value: object,
                                                         message: str) -> None:
    with pytest.raises(LLMException) as e:
        setattr(LLMConfig(), attr, value)
    assert e.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    assert str(e.value) == message


def test_llmconfig_setters_keep_python_types() -> None:
    cfg = LLMConfig()
    for attr, wrong in (("verify_checksum", "1"), ("max_connections", "5"), ("transport", 1),
                        ("max_connections", True), ("verify_checksum", 1)):
        with pytest.raises(TypeError):
            setattr(cfg, attr, wrong)
    cfg.transport = "TCP"
    assert cfg.transport == "tcp"  # as the table reads it
    cfg.max_connections = 9
    cfg.nixl_serve = True
    assert cfg.generate_options()["datadist.MaxConnections"] == "9"
    assert cfg.generate_options()["datadist.NixlServe"] == "1"
    cfg.max_connections = None
    assert cfg.max_connections == 256  # unset: the table's default
    assert "datadist.MaxConnections" not in LLMConfig().generate_options()


def test_no_environment_variable_is_read_by_the_api() -> None:
    """Every DATADIST_ variable is the core's table's (or a non-api module's)."""
    found = subprocess.run(["grep", "-rn", "DATADIST_", str(ROOT / "src" / "datadist" / "api")],
                           capture_output=True, text=True)
    assert found.stdout == ""

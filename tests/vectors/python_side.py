"""The Python codec's account of a frame, in the form of the golden frames' summaries
(generate.py's docstring). Who calls: tests/protocol/test_wire_vectors.py (the vectors) and
tests/protocol/test_wire_differential.py (mutated vectors, against the C++ codec's account from
build/cpp/dd_wire_decode, cpp/tests/wire_summary.h). Loaded by path: ``load(name)``."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from datadist.core.errors import RemoteProtocolError
from datadist.wire import protocol as p

HERE = Path(__file__).resolve().parent


def load(name: str) -> ModuleType:
    """tests/vectors/<name>.py as a module (these files are not a package)."""
    mod_name = f"dd_vectors_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod  # dataclasses look their module up while built
    spec.loader.exec_module(mod)
    return mod


def fields_of(msg: p.Message, rid: int) -> tuple[str, dict[str, str]]:
    """A decoded message as the vectors summarise it: its type name and name -> value text.
    Generic over the dataclasses, so a field added to a message shows up by itself (named as
    its attribute); a key is its fields kind, a, b, c."""
    out = {"rid": str(rid)}

    def put(name: str, value: Any) -> None:
        if isinstance(value, p.KeyRef):
            for part in ("kind", "a", "b", "c"):
                put(part, getattr(value, part))
        elif isinstance(value, np.ndarray):
            out[name] = "[" + ",".join(str(int(x)) for x in value.tolist()) + "]"
        elif isinstance(value, (bytes, bytearray, memoryview)):
            out[name] = bytes(value).hex()
        elif isinstance(value, str):
            out[name] = value.encode().hex()
        else:
            out[name] = str(int(value))

    for f in dataclasses.fields(msg):
        put(f.name, getattr(msg, f.name))
    return msg.TYPE.name, out


def describe(frame: bytes) -> str:
    """One whole frame as the Python codec sees it, in dd_wire_decode's words: "refuse
    header", "refuse payload", "incomplete" (the header's length is not what follows), or
    "TYPE name=value ..." with every field and rid, by name. Any exception but
    RemoteProtocolError propagates: that is a finding."""
    if len(frame) < p.HEADER_SIZE:
        return "incomplete"
    try:
        head = p.decode_header(frame[: p.HEADER_SIZE])
    except RemoteProtocolError:
        return "refuse header"
    if head.length != len(frame) - p.HEADER_SIZE:
        return "incomplete"
    try:
        msg = p.decode_payload(head.type, frame[p.HEADER_SIZE :])
    except RemoteProtocolError:
        return "refuse payload"
    name, fields = fields_of(msg, head.request_id)
    return name + "".join(f" {k}={v}" for k, v in sorted(fields.items()))

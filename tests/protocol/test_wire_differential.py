"""The two codecs against each other: every mutation of every golden frame
(tests/vectors/frames.txt) cut short, padded and with each byte flipped, decoded by Python's
codec and by the C++ one (build/cpp/dd_wire_decode, cpp/tests/wire_summary.h). Both must
give the same account of each: the same fields, or a refusal at the same stage (the header
alone, or the payload); neither may fail any other way. A type the C++ library does not speak
must be refused by its header (none since the core speaks NIXL too)."""

from __future__ import annotations

import importlib.util
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(600)


def _python_side() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "dd_vectors_python_side", ROOT / "tests" / "vectors" / "python_side.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


side = _python_side()
gen = side.load("generate")
NOT_SPOKEN_BY_CPP: set[int] = set()


def mutations(frame: bytes) -> Iterator[bytes]:
    """The frame itself; its payload cut at every length and padded by 1 to 8 bytes (the
    header's length following, so that the payload is what is judged); every byte flipped
    (three ways), the header's included."""
    yield frame
    head, body = frame[:12], frame[12:]
    for n in range(len(body)):
        yield head[:8] + struct.pack("<I", n) + body[:n]
    for extra in (1, 2, 4, 8):
        yield head[:8] + struct.pack("<I", len(body) + extra) + body + b"\x01" * extra
    for i in range(len(frame)):
        for bit in (0x01, 0x80, 0xFF):
            yield frame[:i] + bytes([frame[i] ^ bit]) + frame[i + 1:]


def test_both_codecs_give_the_same_account_of_every_mutated_golden_frame(
        cpp_build: Path) -> None:
    tool = cpp_build / "dd_wire_decode"
    frames = sorted({m for v in gen.load() for m in mutations(v.frame)})
    done = subprocess.run([str(tool)], input="".join(f.hex() + "\n" for f in frames),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    cpp = done.stdout.splitlines()
    assert len(cpp) == len(frames)
    differ, kinds = [], set()
    for frame, theirs in zip(frames, cpp, strict=True):
        ours = side.describe(frame)  # raises on anything but RemoteProtocolError
        kinds.add(ours.split(" ")[0] if ours.startswith(("refuse", "incomplete")) else "decoded")
        want = ours
        if frame[3] in NOT_SPOKEN_BY_CPP and ours != "refuse header" and frame[:3] == b"DD\x01":
            want = "refuse header" if int.from_bytes(frame[8:12], "little") <= 64 << 20 else ours
        if theirs != want:
            differ.append(f"{frame.hex()}\n  python: {ours}\n  c++:    {theirs}")
    assert not differ, f"{len(differ)} of {len(frames)} frames differ:\n" + "\n".join(differ[:10])
    assert kinds == {"decoded", "refuse", "incomplete"}, kinds
    assert len(frames) > 10_000

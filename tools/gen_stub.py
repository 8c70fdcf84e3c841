"""Generate the type stub of datadist._core from the built module, or check it is current.

    python tools/gen_stub.py           # rewrite src/datadist/_core/*.pyi
    python tools/gen_stub.py --check   # exit 1, with the diff, where they differ

The stub is what ``mypy --strict`` reads for every call into the C++ core (core/native.py and
the modules beside it), so it must say what the binding does: it is generated, never edited.
pybind11-stubgen reads the signatures and docstrings pybind11 writes for each function
(cpp/python/module.cc: its ``py::arg`` names, ``py::kw_only``, return types such as
``py::typing::Optional<py::str>``), in the interpreter that runs this script, so run it with
the environment the module was built for (``.venv/bin/python tools/gen_stub.py`` after ``pip
install -e '.[test]'``). The generator's version is pinned in pyproject.toml's ``test`` extra
(``STUBGEN``) and the module's pybind11 in its build requirements: another release of either
writes other text. tests/project/test_stub.py runs ``--check`` against the build.

One rewrite after generating: a uint64/uint32 array parameter, which pybind11 3 writes as
``Annotated[ArrayLike, numpy.uint64]`` (it would convert any array-like with a copy), is typed
``numpy.typing.NDArray[numpy.uint64]``, so mypy holds callers to the arrays the core reads
without a conversion.

Who runs it: a developer after changing cpp/python/*.cc; the test and CI's units stage.
Blocks for the second or two pybind11-stubgen takes.
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUB_DIR = ROOT / "src" / "datadist" / "_core"  # __init__.pyi, testing.pyi (a package stub)
MODULE = "datadist._core"
STUBGEN = "3.0.0"  # pyproject.toml's test extra pins the same
REGENERATE = "python tools/gen_stub.py"

HEADER = (f"# Generated from the built {MODULE} by pybind11-stubgen {STUBGEN} ({REGENERATE}):\n"
          "# do not edit; change the binding (cpp/python/) and regenerate "
          "(tests/project/test_stub.py checks it).\n")

# pybind11 3's input name of py::array_t<T, forcecast> -> what our callers must pass.
_ARRAY_LIKE = re.compile(
    r"typing\.Annotated\[numpy\.typing\.ArrayLike, (numpy\.u?int(?:8|16|32|64))\]")


def stubgen_version() -> str | None:
    """The installed pybind11-stubgen's version, None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("pybind11-stubgen")
    except metadata.PackageNotFoundError:
        return None


def _postprocess(text: str) -> str:
    return HEADER + _ARRAY_LIKE.sub(r"numpy.typing.NDArray[\1]", text)


def generate() -> dict[str, str]:
    """{file name under STUB_DIR: text} for the module this interpreter imports. Raises
    RuntimeError (saying what to install) when pybind11-stubgen is missing or is another
    version, or when it fails (its output included)."""
    have = stubgen_version()
    if have != STUBGEN:
        raise RuntimeError(f"pybind11-stubgen {STUBGEN} is needed (found: {have or 'none'}): "
                           f"pip install -e '.[test]'")
    with tempfile.TemporaryDirectory() as out:
        run = subprocess.run(
            [sys.executable, "-m", "pybind11_stubgen", MODULE, "--exit-code", "-o", out],
            capture_output=True, text=True, cwd=ROOT)
        if run.returncode != 0:
            raise RuntimeError(f"pybind11-stubgen failed ({run.returncode}):\n"
                               f"{run.stdout}{run.stderr}")
        made = Path(out) / "datadist" / "_core"
        return {p.name: _postprocess(p.read_text()) for p in sorted(made.glob("*.pyi"))}


def differences(generated: dict[str, str]) -> str:
    """A unified diff of the checked-in stub against ``generated`` ("" when equal)."""
    have = {p.name: p.read_text() for p in sorted(STUB_DIR.glob("*.pyi"))}
    out = []
    for name in sorted(set(have) | set(generated)):
        rel = f"src/datadist/_core/{name}"
        out.extend(difflib.unified_diff(
            have.get(name, "").splitlines(keepends=True),
            generated.get(name, "").splitlines(keepends=True),
            fromfile=f"{rel} (checked in)", tofile=f"{rel} (from the built module)"))
    return "".join(out)


def write(generated: dict[str, str]) -> None:
    STUB_DIR.mkdir(exist_ok=True)
    for old in STUB_DIR.glob("*.pyi"):
        if old.name not in generated:
            old.unlink()
    for name, text in generated.items():
        (STUB_DIR / name).write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 and print the diff where the stub is stale")
    args = parser.parse_args(argv)
    try:
        generated = generate()
    except RuntimeError as e:
        print(f"gen_stub: {e}", file=sys.stderr)
        return 2
    if args.check:
        diff = differences(generated)
        if diff:
            sys.stdout.write(diff)
            print(f"gen_stub: the stub differs from the built module: run `{REGENERATE}`",
                  file=sys.stderr)
            return 1
        return 0
    write(generated)
    return 0


if __name__ == "__main__":
    sys.exit(main())

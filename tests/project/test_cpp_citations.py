"""Every Python file and Python name a comment in cpp/src cites exists.

The core's comments point at the Python package where a rule came from or is mirrored
("as Python's Registry.open", "transport/nixl.py's KEY_CHECKED_TLS"). When the Python side
moves, those pointers rot silently; this test reads them.

What counts as a citation (only inside comments: ``//`` to the end of the line, and
``/* ... */``; string literals are skipped):

1. a Python file path, a word ending in ``.py`` (``core/layout.py``,
   ``tests/security/test_same_host_trust.py``): it must exist relative to the repository
   root, ``src/`` or ``src/datadist/``;
2. a dotted name rooted at the package whose first part is lower case, ``datadist.a.b``: a
   module or package ``datadist.a.b``, or a name defined in module ``datadist.a``
   (``datadist.Transport`` and its kind are option names, not Python names);
3. ``Class.member`` with a CamelCase class (at least one lower-case letter, so protocol names
   such as ``WELCOME.proof`` are not taken): C++ writes its own members ``Class::member``, so
   a dot there means a Python class. Some class of that name under src/datadist must define
   ``member`` (a method, or an attribute assigned or annotated in its body);
4. what follows ``Python's`` or ``(Python:`` when it is a name rather than a word: it holds
   an underscore, a dot or a capital letter (``Python's shm_pays``, ``Python's
   registry.KeyId``, ``Python's LLMStatusCode``; not ``Python's codec``). A bare name must be
   defined somewhere under src/datadist; ``module.name`` needs a module of that basename
   defining it, ``Class.member`` as in 3; a builtin (``bytes.fromhex``) or standard-library
   (``mmap.PAGESIZE``) name counts as existing.

"Defined" is read from the source (AST), nothing is imported: functions, classes, and names
assigned or annotated at module or class level.
"""

from __future__ import annotations

import ast
import builtins
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CPP_SRC = ROOT / "cpp" / "src"
PKG = ROOT / "src" / "datadist"

PATH_RE = re.compile(r"(?<![\w/.-])([\w./-]*\w\.py)\b")
PACKAGE_RE = re.compile(r"\bdatadist(?:\.[a-z_]\w*)(?:\.[A-Za-z_]\w*)*")
MEMBER_RE = re.compile(r"(?<![\w.:])([A-Z]\w*[a-z]\w*)\.([A-Za-z_]\w*)\b(?!\.(?:h|cc|md|py)\b)")
PYTHONS_RE = re.compile(r"(?:Python's|\(Python:)\s+([A-Za-z_][\w.]*\w)")


def comments(text: str) -> list[tuple[int, str]]:
    """(line number, comment text) of every comment in C++ source ``text``."""
    out: list[tuple[int, str]] = []
    i, line, n = 0, 1, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append((line, text[i + 2:end]))
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end
            for k, part in enumerate(text[i + 2:end].split("\n")):
                out.append((line + k, part))
            line += text.count("\n", i, end)
            i = end + 2
        elif c in "\"'":
            if c == "'" and i and (text[i - 1].isalnum()):  # a digit separator: 1'000
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        elif text.startswith('R"', i):  # raw strings do not occur in cpp/src; be safe
            i += 2
        else:
            i += 1
    return out


class Index:
    """What src/datadist defines: module dotted names, names per module, members per class."""

    def __init__(self) -> None:
        self.modules: dict[str, set[str]] = {}  # "datadist.core.registry" -> names
        self.by_basename: dict[str, set[str]] = defaultdict(set)  # "registry" -> names
        self.classes: dict[str, set[str]] = defaultdict(set)  # "Registry" -> members
        self.names: set[str] = set()
        for path in sorted(PKG.rglob("*.py")):
            rel = path.relative_to(PKG.parent).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            dotted = ".".join(parts)
            tree = ast.parse(path.read_text())
            defined = self._defined(tree.body)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    members = self._defined(node.body)
                    self.classes[node.name] |= members
                    self.names |= members
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    self.names.add(node.name)
            self.modules[dotted] = defined
            self.by_basename[parts[-1]] |= defined
            self.names |= defined

    @staticmethod
    def _defined(body: list[ast.stmt]) -> set[str]:
        names: set[str] = set()
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for t in ast.walk(target):
                        if isinstance(t, ast.Name):
                            names.add(t.id)
                        elif isinstance(t, ast.Attribute):
                            names.add(t.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    names.add((alias.asname or alias.name).split(".")[0])
            elif isinstance(node, (ast.If, ast.Try)):
                names |= Index._defined(node.body)
        # self.x = ... in methods counts as a member of the class too
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Assign, ast.AnnAssign)):
                        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                        for t in targets:
                            if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                    and t.value.id == "self"):
                                names.add(t.attr)
        return names

    def package_name(self, dotted: str) -> bool:
        if dotted in self.modules:
            return True
        module, _, name = dotted.rpartition(".")
        return module in self.modules and name in self.modules[module]

    def member(self, cls: str, member: str) -> bool:
        return cls in self.classes and member in self.classes[cls]

    def name(self, dotted: str) -> bool:
        head, _, rest = dotted.partition(".")
        if not rest:
            return dotted in self.names or hasattr(builtins, dotted)
        if hasattr(builtins, head) or _stdlib(head):
            return True
        if head in self.classes:
            return self.member(head, rest.split(".")[0])
        if head in self.by_basename:
            return rest.split(".")[0] in self.by_basename[head]
        return dotted.startswith("datadist.") and self.package_name(dotted)


def _stdlib(name: str) -> bool:
    return name in sys.stdlib_module_names


def _path_exists(cited: str) -> bool:
    cited = cited.lstrip("./")
    return any((base / cited).is_file() for base in (ROOT, ROOT / "src", PKG))


def _identifier_like(token: str) -> bool:
    return "_" in token or "." in token or any(ch.isupper() for ch in token)


def citations(index: Index, text: str) -> list[tuple[int, str, bool]]:
    """(line, what is cited, does it exist) for every citation (module docstring) in the
    comments of C++ source ``text``."""
    found: list[tuple[int, str, bool]] = []
    for line, comment in comments(text):
        for m in PATH_RE.finditer(comment):
            found.append((line, m.group(1), _path_exists(m.group(1))))
        for m in PACKAGE_RE.finditer(comment):
            found.append((line, m.group(0), index.package_name(m.group(0))))
        for m in MEMBER_RE.finditer(comment):
            found.append((line, m.group(0), index.member(m.group(1), m.group(2))))
        for m in PYTHONS_RE.finditer(comment):
            token = m.group(1).rstrip(".")
            if _identifier_like(token) and not token.endswith(".py"):
                found.append((line, token, index.name(token)))
    return list(dict.fromkeys(found))  # a name both rules see is reported once


def _cpp_sources() -> list[Path]:
    return sorted([*CPP_SRC.glob("*.h"), *CPP_SRC.glob("*.cc")])


# ------------------------------------------------------------------------ the rule itself


def test_comments_are_found_and_strings_are_not(tmp_path: Path) -> None:
    src = ('int a = 1\'000;  // see core/layout.py\n'
           'const char *s = "not // a comment core/gone.py";\n'
           '/* block\n   Registry.open */\n')
    assert comments(src) == [(1, " see core/layout.py"), (3, " block"),
                             (4, "   Registry.open ")]


def test_each_kind_of_citation_is_checked(tmp_path: Path) -> None:
    """A citation of something that exists passes, one of something gone is reported: one
    pair per kind of citation the module docstring names."""
    index = Index()
    cited = tmp_path / "x.h"
    cited.write_text(
        "// core/layout.py and core/links.py\n"
        "// datadist.core.keys.KeyRef and datadist.core.keys.Gone\n"
        "// as NativeEngine.register, not NativeEngine.settle; WELCOME.proof is the protocol's\n"
        "// Python's keys.KeyId and Python's CmaPath; Python's codec is a word\n"
        "// (Python: mmap.PAGESIZE), Python's bytes.fromhex; datadist.Transport, an option\n")
    stale = sorted(what for _, what, ok in citations(index, cited.read_text()) if not ok)
    assert stale == ["CmaPath", "NativeEngine.settle", "core/links.py", "datadist.core.keys.Gone"]


# ------------------------------------------------------------------------ the tree


def test_every_python_citation_in_cpp_src_exists() -> None:
    index = Index()
    stale = [f"{path.relative_to(ROOT).as_posix()}:{line}: {what}"
             for path in _cpp_sources()
             for line, what, ok in citations(index, path.read_text()) if not ok]
    assert not stale, ("cpp/src comments cite Python files or names that do not exist "
                       "(fix the comment; the rule is this file's docstring):\n  "
                       + "\n  ".join(stale))

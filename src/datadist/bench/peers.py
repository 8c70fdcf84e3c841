"""Lines about peer libraries (NIXL, Mooncake) when they are importable."""

from __future__ import annotations

import importlib.util

# import names of each peer: the nixl-cu12 / nixl-cu13 wheels name their module after the
# wheel, the source build names it "nixl"
PEERS = (("NIXL", ("nixl", "nixl_cu12", "nixl_cu13")), ("Mooncake", ("mooncake",)))


def importable(modules: tuple[str, ...]) -> str | None:
    """The first of ``modules`` that can be imported, or None."""
    for mod in modules:
        try:
            if importlib.util.find_spec(mod) is not None:
                return mod
        except (ImportError, ValueError):
            continue
    return None


def peer_lines() -> list[str]:
    """What the peers' rows are, or why they do not run: NIXL and Mooncake are never
    installed by the benchmark."""
    lines = []
    for name, modules in PEERS:
        mod = importable(modules)
        if mod is None:
            tried = ", ".join(repr(m) for m in modules)
            lines.append(f"{name}: skipped, no python module of {tried} is importable")
        elif name == "NIXL":
            lines.append(f"NIXL: module {mod!r} importable; the nixl rows (--only nixl) hold "
                         "datadist's NIXL path against NIXL driven directly")
        else:
            lines.append(f"{name}: module {mod!r} importable; the mooncake rows hold datadist's "
                         "TCP path beside Mooncake's TCP transfer engine, same workloads")
    return lines

"""Every public class of the library's layers, and every ``LLMConfig`` property, says what it
is in a docstring (issue 14). Public: a name without a leading underscore, in a module of
datadist.api, core, memory or wire whose own name has none either."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from datadist.api.config import LLMConfig

LAYERS = ("api", "core", "memory", "wire")


def _modules() -> list[str]:
    names = []
    for layer in LAYERS:
        pkg = importlib.import_module(f"datadist.{layer}")
        names.append(pkg.__name__)
        for info in pkgutil.iter_modules(pkg.__path__, prefix=f"{pkg.__name__}."):
            if not info.name.rsplit(".", 1)[1].startswith("_"):
                names.append(info.name)
    return names


def _public_classes() -> list[tuple[str, type]]:
    found: dict[str, type] = {}
    for name in _modules():
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            # Defined here (not imported), public, a class.
            if (inspect.isclass(obj) and not attr.startswith("_")
                    and obj.__module__ == module.__name__):
                found[f"{module.__name__}.{obj.__qualname__}"] = obj
    return sorted(found.items())


def _own_doc(cls: type) -> str:
    """The class's own docstring: not one inherited, and not the one that ``dataclass``
    writes for a class without any (its signature)."""
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(f"{cls.__name__}("):
        return ""
    return doc.strip()


def test_the_walk_finds_the_layers() -> None:
    names = dict(_public_classes())
    # A broken walk would pass with nothing to check.
    assert "datadist.api.config.LLMConfig" in names
    assert "datadist.wire.protocol.Hello" in names
    assert "datadist.core.native.CacheEntry" in names
    assert len(names) > 50


@pytest.mark.parametrize("name", [n for n, _ in _public_classes()])
def test_public_class_has_a_docstring(name: str) -> None:
    cls = dict(_public_classes())[name]
    assert _own_doc(cls), f"{name} has no docstring"


LLMCONFIG_PROPERTIES = sorted(n for n, v in vars(LLMConfig).items() if isinstance(v, property))


def test_llmconfig_has_its_properties() -> None:
    assert {"device_id", "listen_ip_info", "sync_kv_timeout", "transport"} <= set(
        LLMCONFIG_PROPERTIES)


@pytest.mark.parametrize("name", LLMCONFIG_PROPERTIES)
def test_llmconfig_property_has_a_docstring(name: str) -> None:
    prop = vars(LLMConfig)[name]
    assert (prop.__doc__ or "").strip(), f"LLMConfig.{name} has no docstring"


"""An LLMConfig option set to None is unset: ``generate_options`` emits nothing for it, so
the default (or the environment variable) applies. Found while typing the module (issue 14):
``allow_ptrace = None`` emitted ``datadist.AllowPtrace`` "0", turning the default on to off."""

from __future__ import annotations

import pytest

from datadist.api.config import OPT_ALLOW_PTRACE, OPT_SWITCH_ROLE, OPT_VERIFY, LLMConfig


@pytest.mark.parametrize(("name", "key"), [("allow_ptrace", OPT_ALLOW_PTRACE),
                                           ("verify_checksum", OPT_VERIFY),
                                           ("enable_switch_role", OPT_SWITCH_ROLE)])
def test_none_emits_nothing(name: str, key: str) -> None:
    cfg = LLMConfig()
    setattr(cfg, name, None)
    assert key not in cfg.generate_options()


def test_allow_ptrace_false_still_opts_out() -> None:
    cfg = LLMConfig()
    cfg.allow_ptrace = False
    assert cfg.generate_options()[OPT_ALLOW_PTRACE] == "0"
    cfg = LLMConfig()
    cfg.allow_ptrace = True
    assert OPT_ALLOW_PTRACE not in cfg.generate_options()

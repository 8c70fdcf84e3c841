"""``llm_datadist.utils.log`` under its own name: module-level logging helpers.

datadist logs through the standard ``logging`` tree under ``"datadist"``; these functions
write there. Unlike llm_datadist, importing this adds no handler and sets no level: that is
the application's choice.
"""

from __future__ import annotations

import logging
import sys
import traceback
from types import FrameType
from typing import Any


def get_logger() -> logging.Logger:
    return logging.getLogger("datadist")


def info(msg: Any, *args: Any, **kwargs: Any) -> None:
    get_logger().info(msg, *args, **kwargs)


def warn(msg: Any, *args: Any, **kwargs: Any) -> None:
    get_logger().warning(msg, *args, **kwargs)


def error(msg: Any, *args: Any, **kwargs: Any) -> None:
    get_logger().error(msg, *args, **kwargs)


def _find_caller(stack_info: bool = False,
                 stack_level: int = 1) -> tuple[str, int, str, str | None]:
    """llm_datadist's ``Logger.findCaller`` replacement (its utils/log.py, which installs it on
    its logger; its tests/python/test_log.py calls it from a thread): the file, line, function
    (and, with ``stack_info``, the stack) of the first frame, counting outwards from three
    frames above this one, whose file is not that frame's file; "(unknown file)", 0,
    "(unknown function)", None when there is none. ``stack_level`` is accepted and unused, as
    there. datadist's own logger keeps the standard ``findCaller``."""
    f: FrameType | None = sys._getframe(3)
    assert f is not None
    log_file = f.f_code.co_filename
    rv: tuple[str, int, str, str | None] = ("(unknown file)", 0, "(unknown function)", None)
    while f:
        f = f.f_back
        if f is None:
            break
        code = f.f_code
        if code.co_filename != log_file:
            sinfo = ("Stack (most recent call last):\n" + "".join(traceback.format_stack(f))
                     if stack_info else None)
            rv = (code.co_filename, f.f_lineno, code.co_name, sinfo)
            break
    return rv


__all__ = ["get_logger", "info", "warn", "error"]

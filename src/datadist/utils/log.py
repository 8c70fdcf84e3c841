"""``llm_datadist.utils.log`` under its own name: module-level logging helpers.

datadist logs through the standard ``logging`` tree under ``"datadist"``; these functions
write there. Unlike llm_datadist, importing this adds no handler and sets no level: that is
the application's choice.
"""

from __future__ import annotations

import logging
from typing import Any


def get_logger() -> logging.Logger:
    return logging.getLogger("datadist")


def info(msg: Any, *args: Any, **kwargs: Any) -> None:
    get_logger().info(msg, *args, **kwargs)


def warn(msg: Any, *args: Any, **kwargs: Any) -> None:
    get_logger().warning(msg, *args, **kwargs)


def error(msg: Any, *args: Any, **kwargs: Any) -> None:
    get_logger().error(msg, *args, **kwargs)


__all__ = ["get_logger", "info", "warn", "error"]

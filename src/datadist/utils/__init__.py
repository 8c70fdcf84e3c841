"""``llm_datadist.utils`` under its own name: :mod:`datadist.utils.log` and
:mod:`datadist.utils.utils`."""

from datadist.utils import log, utils

__all__ = ["log", "utils"]

"""Planned requests: a pull's checked arguments and the call the core planned for them
(Engine.prepare_pull), kept for the next call with the same arguments.

A serving process repeats its pulls: the same block of a small cache, the same blocks layer
by layer. Checking the arguments and planning the transfer cost more Python time than the copy
of a 16 KiB block (issue 23: ~12 us of a 23 us call). A pull whose arguments equal those of an
earlier one that passed every check gets that call's prepared call back here, instead of
checking and planning again; and a blocking pull's hit is one native call that builds the key,
finds the call and runs it (``run_blocks`` / ``run_slot``: the key built in Python and its
lookup were most of a same-host 16 KiB pull's interpreter work, docs/performance.md, "Round 15").

The map is the binding's ``PlannedPulls`` (cpp/python/planned.h), one per manager. What
"equal" means is the safety of this module, kept there: the key is built only from values
whose every check is a pure function of the key, and whose type is exactly the one the checks
accept (an ``int`` and not a bool, a ``range`` by its start, stop and step, a key class by its
int fields, a block list of exact ints in [0, 2**64), each int within 64 bits). Anything else
(a numpy array of blocks, a subclass, a bool, an unknown keyword, a list of more than
SMALL_REQUEST items) has no key: the call takes the full path, which raises what is wrong. The
destination ``Cache`` is part of the key by identity (held, so its address cannot name another
object). What the key cannot cover is checked on every call, hit or miss: the manager's
session open (the caller, before the lookup), the engine not closed (its maps are closed with
it: nothing is found from then on), and the local cache still registered with the addresses
the plan was made for (the core, on every run: an unregistered or replaced cache never reuses
a plan). A link change needs nothing here: the request names the cluster, and the engine
looks its link up on every transfer.

Who calls: :class:`datadist.api.cache_manager.CacheManager`, on every pull; one map per
manager (a finalized session's map goes with it). Never blocks beyond the hit's transfer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from datadist.api.types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex
from datadist.core.prepared import KEPT, KEPT_ROWS, SMALL_REQUEST

if TYPE_CHECKING:
    from datadist._core import PlannedPulls
    from datadist.core.native import NativeEngine


def new_map(engine: NativeEngine, size: int = KEPT, max_weight: int = KEPT_ROWS) -> PlannedPulls:
    """A map of ``engine``'s planned pulls: at most ``size`` calls, and ``max_weight`` local
    spans in all (the newest always kept), the least recently used going first with a second
    chance (a hit marks its entry; a put that must evict passes over the oldest entries,
    moving the ones used since to the end unmarked and evicting the first that was not)."""
    return engine.planned_pulls(size, max_weight, SMALL_REQUEST,
                                (BlocksCacheKey, CacheKeyByIdAndIndex, CacheKey))

"""The datadist benchmark: every figure beside the limit it is held against (docs/performance.md).

Who calls: ``datadist bench`` (cli.py), ``python -m datadist.bench`` and
``benchmarks/run.py``, all through :func:`main`. Blocks for the whole run: a few seconds with
``--quick``, under a minute at full size. Prints a progress bar on stderr, the table on stdout,
and writes JSON with ``--json PATH``.

Theory of operation
-------------------
Machines are shared and noisy; absolute numbers drift by tens of percent from run to run. So
every figure is a ratio to a *limit* measured in the same run, on the same buffers, between the
same two processes. The owner (the prompt side) is a child process started with
multiprocessing's ``spawn``; the puller (the decoder side) is this process. Both sides use only
the public API (``import datadist as llm_datadist``); the limits use ctypes and plain sockets.
Both sides run on the C++ core (``datadist._core``, the one engine: docs/engine.md).

Rules this module keeps:

1. Figure and limit repetitions are interleaved, so that drift hits both; each number is the
   median of its repetitions (``--repeat``), after one untimed warm-up.
2. After the warm-up the destination bytes are checked against the pattern the owner wrote:
   a fast pull of wrong bytes must fail the run, not win it.
3. Client buffers are page-aligned on both sides by default. numpy's own large arrays start 16
   bytes past a page, and a copy whose ends differ by 8..256 bytes modulo 4096 runs about 4x
   slower ("4K aliasing"); aligning both ends, as docs/performance.md measures its limits, keeps the
   comparison fair. ``--align numpy`` keeps numpy's placement; the output says which was used.

Modules: :mod:`.harness` (sizes, patterns, rows, alternation), :mod:`.owner` (the child
process), :mod:`.limits` (raw process_vm_readv, memcpy, plain sockets), :mod:`.puller` (the
decoder side), one module per group of rows (:mod:`.same_host`, :mod:`.tcp`, :mod:`.plan`,
:mod:`.stall`: honest pulls beside stalled clients, with its own owners),
:mod:`.peers`, and :mod:`.runner` (a run, the table, the command line).
"""

from datadist.bench.harness import BenchError, Progress, Row, Sizes
from datadist.bench.runner import GROUPS, main, run, timed_steps
from datadist.bench.table import format_table

__all__ = ["GROUPS", "BenchError", "Progress", "Row", "Sizes", "format_table", "main", "run",
           "timed_steps"]

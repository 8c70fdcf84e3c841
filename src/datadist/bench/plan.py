"""Rows of planning cost: how long turning 100k block indices into spans takes.
"""

from __future__ import annotations

import numpy as np

from datadist.bench.harness import (
    PLAN_GOAL_MS,
    Progress,
    Row,
    Sizes,
    timed,
)


def plan_rows(sizes: Sizes, repeat: int, progress: Progress) -> list[Row]:
    """Planning cost: ``layout.plan_blocks`` from numpy arrays, and from Python lists through
    the api's ``int_list`` conversion (what ``pull_blocks`` does with a client's lists)."""
    from datadist.api.checks import int_list
    from datadist.core import layout

    n = sizes.plan_blocks
    rng = np.random.default_rng(7)
    units = 2 * n
    geo = layout.Geometry(2, units * sizes.block_bytes, units, True)
    src = rng.permutation(units)[:n].astype(np.int64)
    dst = rng.permutation(units)[:n].astype(np.int64)
    src_l, dst_l = src.tolist(), dst.tolist()

    def from_numpy() -> None:
        tensors = layout.every_tensor(geo.num_tensors)
        layout.plan_blocks(geo, src, dst, tensors)

    def from_lists() -> None:
        s = int_list("src_blocks", src_l, "uint64", types=(list, tuple, np.ndarray))
        d = int_list("dst_blocks", dst_l, "uint64", types=(list, tuple, np.ndarray))
        tensors = layout.every_tensor(geo.num_tensors)
        layout.plan_blocks(geo, s, d, tensors)

    rows = []
    for key, title, fn in (
        ("plan_numpy", f"plan {n // 1000}k blocks, numpy arrays", from_numpy),
        ("plan_lists", f"plan {n // 1000}k blocks, Python lists (int_list)", from_lists),
    ):
        progress.set_label(title)
        fn()
        samples = []
        for _ in range(repeat):
            samples.append(timed(fn) * 1e3)
            progress.step()
        fig = float(np.median(samples))
        rows.append(Row(key, title, "ms", fig, goal=f"< {PLAN_GOAL_MS:g} ms",
                        met=fig < PLAN_GOAL_MS, figure_samples=samples))
    return rows

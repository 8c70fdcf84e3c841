"""Runnable demonstrations of datadist with real workloads.

Nothing here is imported by ``import datadist``. Each demo imports its own heavy dependencies
(torch, transformers) when it runs, so a plain install never needs them.
"""

"""``llm_datadist.v2.config`` under its own name.

llm_datadist's ``ClusterConfig`` and ``EngineConfig`` are left out: they write and read the
NPU NUMA resource file and the ``llm.ClusterInfo`` option that legacy-mode ``init`` hands to
GE. datadist's legacy mode needs neither (docs/compatibility.md).
"""

__all__: list[str] = []

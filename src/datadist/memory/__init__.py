"""Memory that datadist allocates, and adapters for the memory users bring.

``shared_empty`` / ``shared_tensor`` give page-aligned numpy arrays / torch tensors in
shareable memory, which same-host decoders copy at memcpy speed (see the README, "Data paths").
"""

from datadist.memory.shared import shared_empty, shared_tensor

__all__ = ["shared_empty", "shared_tensor"]

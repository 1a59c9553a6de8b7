"""DeepSpeed checkpoints: a run or tag folder (``folder``), the ZeRO partitions rebuilt
into fp32 master weights (``zero``, ``flat``), and universal checkpoints (``universal``)."""

from __future__ import annotations

from .folder import detect, read
from .tag_folder import FORMAT

__all__ = ["FORMAT", "detect", "read"]

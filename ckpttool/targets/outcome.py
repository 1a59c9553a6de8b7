"""What a write that can resume did, for the summary line: the same words whichever
route resumed (the ranks' units, S3's parts)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Outcome:
    """What a resumable write did.

    Attributes:
        units: Units (or parts) in the output.
        reused: Of them, those an interrupted run had made durable, not written again.
        reused_bytes: Their bytes.
        note: Why earlier work was dropped, or "".
        kind: What a unit is called: ``unit`` (the ranks), ``part`` (S3's multipart).
    """

    units: int
    reused: int = 0
    reused_bytes: int = 0
    note: str = ""
    kind: str = "unit"

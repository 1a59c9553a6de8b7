"""The files a folder output consists of (Hugging Face shards and their index, a DCP
folder): what a run writes, what ``--force`` may replace, and which file comes last."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class FolderLayout:
    """The files a folder output consists of: what a run writes and what ``--force``
    may replace in that folder (an earlier run's files), and nothing else.

    Attributes:
        kind: What it is, for messages.
        pattern: The names of its files, this run's and those of earlier runs.
        last: The file that makes the folder a checkpoint (index, metadata): moved in
            after the data files it names, so a reader never finds it before them.
    """

    kind: str
    pattern: re.Pattern[str]
    last: str

    def owns(self, name: str) -> bool:
        return self.pattern.fullmatch(name) is not None


# the names writers/safetensors.py and writers/dcp.py write
HF_SHARDS = FolderLayout(
    "Hugging Face shards",
    re.compile(r"model-\d+-of-\d+\.safetensors|model\.safetensors\.index\.json"),
    "model.safetensors.index.json",
)
DCP_FILES = FolderLayout("a DCP checkpoint", re.compile(r"\.metadata|[^/]*\.distcp"), ".metadata")
FOLDER_LAYOUTS = (HF_SHARDS, DCP_FILES)

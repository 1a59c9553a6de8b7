"""``torch-legacy`` (formats/torch_legacy.py): the pre-1.6 torch.save stream."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_identical, small_state_dict

import ckpttool


@pytest.mark.parametrize("protocol", [2, 1])
def test_legacy_reads_the_same_as_torch_load(tmp_path, protocol):
    """The legacy stream reader agrees with torch.load on every tensor, also for a file
    written with pickle_protocol=1 (its magic number is text: it was not detected)."""
    original = {"model": small_state_dict(), "epoch": 2}
    path = tmp_path / "legacy.pt"
    torch.save(original, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    # weights_only=True refuses protocol 1's opcodes; the file is torch's own here
    reference = torch.load(path, weights_only=protocol == 2)
    assert ckpttool.read(path).format == "torch-legacy"
    everything = ckpttool.load(path, select="all")
    assert_identical(everything, reference, ordered=False, exact_types=False)

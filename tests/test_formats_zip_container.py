"""The zip container (formats/zip_container.py): what torch writes into it and reads from it."""

from __future__ import annotations

from helpers import assert_identical, run_cli, small_state_dict

import ckpttool


def test_file_saved_without_crcs_is_read(tmp_path):
    """``torch.utils.serialization.config.save.compute_crc32 = False`` writes every CRC as 0;
    torch.load reads such files, so do we (a real CRC mismatch is still corruption)."""
    import zipfile

    import torch.utils.serialization

    config = torch.utils.serialization.config.save
    sd = small_state_dict()
    # not monkeypatch: its undo deletes the option from torch's config module for good
    was, config.compute_crc32 = config.compute_crc32, False
    try:
        torch.save(sd, tmp_path / "nocrc.pt")
    finally:
        config.compute_crc32 = was
    assert {i.CRC for i in zipfile.ZipFile(tmp_path / "nocrc.pt").infolist()} == {0}
    assert_identical(ckpttool.load(tmp_path / "nocrc.pt"), sd)
    proc = run_cli("convert", tmp_path / "nocrc.pt", "--to", "pt", "-o", tmp_path / "o.pt")
    assert proc.returncode == 0, proc.stderr
    assert_identical(torch.load(tmp_path / "o.pt", weights_only=True), sd)

"""The zip format's records, defined once: the reader (formats/zip_container.py) and
the torch-zip writer (writers/torch_zip.py) both use these layouts.

Each record is a little-endian ``struct`` starting with its 4-byte signature
(APPNOTE.TXT sections 4.3.7 to 4.3.16); names and extra fields follow some of them.
"""

from __future__ import annotations

import struct

ZIP_MAGIC = b"PK\x03\x04"  # a local file header's signature: what a zip file starts with

LOCAL_HEADER_SIGNATURE = 0x04034B50
CENTRAL_HEADER_SIGNATURE = 0x02014B50
ZIP64_END_SIGNATURE = 0x06064B50
ZIP64_LOCATOR_SIGNATURE = 0x07064B50
END_SIGNATURE = 0x06054B50

LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # 30 bytes, then name and extra
CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes, then name, extra, comment
ZIP64_END = struct.Struct("<IQHHIIQQQQ")  # the zip64 end of central directory record
ZIP64_LOCATOR = struct.Struct("<IIQI")  # where the zip64 end record is
END = struct.Struct("<IHHHHIIH")  # the end of central directory record, then a comment

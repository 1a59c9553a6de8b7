"""Every relative link of the user docs (README.md, docs/*.md) names a file that exists,
and an anchor in it names a heading of that file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces
    as dashes."""
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_points_at_a_file_that_exists(page: Path):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # a URL (https:, mailto:)
            continue
        name, _, anchor = target.partition("#")
        file = (page.parent / name).resolve() if name else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert broken == [], broken

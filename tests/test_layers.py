"""The house's layers, enforced (issue 41, item 6): every import inside the package, deferred
ones included, points down or sideways within one package; no module outgrows its size.

The floors, top to bottom (a package imports only packages on lower floors, and itself):

    cli > the root's face > verbs (convert, merge, diff, inspection, unsafe)
        > hf_export > integrity > targets (where bytes go) > mappings
        > writers (what bytes) | api | distributed
        > formats > sharing | stats > unpickler | tensors | zip_records > tree > sources
        > dtypes | guard | sizes | progress | heap > sealed > errors

Inside ``formats/`` the families are floors of their own (:data:`FAMILIES`): the registry
over the framework layouts and folder rules, over DCP | per-rank files (independent of each
other), over torch.save | safetensors, over the engines they share (the records spill, the
pickle skeleton walkers, the local shards, the checkpoint a reader returns).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ckpttool"
FLOORS = {
    "__main__": 12,
    "cli": 11,
    "": 10,  # ckpttool/__init__.py: the public face, lazily
    "convert": 9,
    "merge": 9,
    "diff": 9,
    "inspection": 9,
    "unsafe": 9,
    "hf_export": 8.7,  # convert --to hf: a mapping written through publish
    "integrity": 8.5,  # what a file must hold, checked: verify, and before convert and merge
    "targets": 8,
    "mappings": 7.5,  # HF architectures and the specs that map layouts to them
    "writers": 7,
    "api": 7,
    "distributed": 7,
    "formats": 6,
    "sharing": 5,
    "stats": 5,  # inspect --stats: a tensor's numbers, read
    "unpickler": 4,
    "tensors": 4,
    "zip_records": 4,
    "tree": 3,
    "sources": 2,
    "dtypes": 1,
    "guard": 1,
    "sizes": 1,
    "progress": 1,
    "sealed": 0.5,  # the frozen types dtypes builds on
    "heap": 1,
    "errors": 0,
}
# ckpttool.formats.<family>: its floor inside formats (a family imports only lower ones:
# never a sibling on its own floor)
FAMILIES = {
    "": 4,  # the registry: formats/__init__.py
    "entries": 4.5,  # a folder's entries by the registry's lists (the registry imports it lazily)
    "folders": 3,  # which checkpoint a folder is; folders of several; run folders; HF index
    "megatron": 3,
    "deepspeed": 3,
    "dcp": 2,
    "per_rank": 2,
    "torch_save": 1,
    "safetensors_file": 1,
    "skeleton": 0.5,  # the pickle skeleton walkers of the scale readers, over their records
    "records": 0,
    "local_shards": 0,
    "made": 0,
    "prescan": 0,
}
MAX_LINES = 450
# modules past MAX_LINES today, at their size: they may shrink, never grow (the debt
# issue 41 names; a new module past the limit fails at once)
OVER = {
    "formats/skeleton/metadata_runs.py": 735,
    "targets/s3.py": 787,
    "formats/per_rank/__init__.py": 623,
    "unpickler/policy.py": 664,
    "formats/torch_save/zip_pickle.py": 645,
    "unpickler/restricted.py": 640,
    "unpickler/pickle_scan.py": 569,
    "targets/local.py": 557,
    "formats/folders/run_folders.py": 520,
    "writers/torch_zip.py": 505,
    "formats/skeleton/shard_runs.py": 494,
}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path) -> set[str]:
    """The ``ckpttool`` modules (or packages) ``name`` imports, anywhere in it."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "ckpttool" or target.startswith("ckpttool."):
                # each name may be a module of that package: the deepest one known counts
                found |= {f"{target}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "ckpttool"}
    return found


def resolved_imports(known: dict[str, Path]) -> list[tuple[str, str]]:
    """(importer, imported module) for every import of the package, a name imported from
    a module resolved to that module."""
    pairs = []
    for name, path in sorted(known.items()):
        for target in sorted(imports(name, path)):
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            pairs.append((name, target))
    return pairs


def floor_of(module: str) -> tuple[str, int]:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    assert top in FLOORS, f"{module}: on no floor (add its package to FLOORS)"
    return top, FLOORS[top]


def test_every_import_points_down_or_within_its_package():
    upward = []
    for name, target in resolved_imports(modules()):
        (mine, mine_floor), (theirs, their_floor) = floor_of(name), floor_of(target)
        if theirs != mine and their_floor >= mine_floor:
            upward.append(f"{name} -> {target}")
    assert upward == []


def family_of(module: str) -> tuple[str, int]:
    parts = module.split(".")
    family = parts[2] if len(parts) > 2 else ""
    assert family in FAMILIES, f"{module}: in no family (add it to FAMILIES)"
    return family, FAMILIES[family]


def test_format_families_import_only_lower_families():
    sideways = []
    for name, target in resolved_imports(modules()):
        if not (name.startswith("ckpttool.formats") and target.startswith("ckpttool.formats")):
            continue
        (mine, mine_floor), (theirs, their_floor) = family_of(name), family_of(target)
        if theirs != mine and their_floor >= mine_floor:
            sideways.append(f"{name} -> {target}")
    assert sideways == []


def test_no_module_outgrows_its_size():
    grown = []
    for path in sorted(PACKAGE.rglob("*.py")):
        key = str(path.relative_to(PACKAGE))
        lines = len(path.read_text().splitlines())
        allowed = OVER.get(key, MAX_LINES)
        if lines > allowed:
            grown.append(f"{key}: {lines} lines (at most {allowed})")
    assert grown == []


def test_the_layout_table_names_every_package_and_family():
    """``docs/development.md``'s layout table has a row naming each floor and family."""
    table = (PACKAGE.parent / "docs" / "development.md").read_text()
    rows = "\n".join(line for line in table.splitlines() if line.startswith("| `"))
    missing = []
    for name in sorted(FLOORS):
        if name in ("", "__main__"):
            continue
        spelled = f"`{name}/`" if (PACKAGE / name).is_dir() else f"`{name}.py`"
        if spelled not in rows:
            missing.append(spelled)
    formats = PACKAGE / "formats"
    for name in sorted(FAMILIES):
        if name:
            spelled = f"`{name}/`" if (formats / name).is_dir() else f"`{name}.py`"
            if spelled not in rows:
                missing.append(f"formats: {spelled}")
    assert missing == []


def face_names(package: Path) -> set[str]:
    """The names a package's ``__init__`` binds: its face (imports, defs, assignments)."""
    names = set()
    for node in ast.parse((package / "__init__.py").read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_no_package_face_is_bypassed_from_outside():
    """An import from outside a package names the package (or a sub-package: a face of
    its own) and a name its ``__init__`` binds, never one of its modules."""
    known = modules()
    bypassed = []
    for name, path in sorted(known.items()):
        mine = name.split(".")[1] if name.count(".") else ""
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            parts = target.split(".")
            if parts[0] != "ckpttool" or len(parts) < 2 or parts[1] == mine:
                continue
            where = PACKAGE.joinpath(*parts[1:])
            if not where.is_dir():  # a module, not a package: below some face
                if (where.parent / "__init__.py").exists() and where.parent != PACKAGE:
                    bypassed.append(f"{name}: from {target} import ...")
                continue
            face = face_names(where)
            for alias in node.names:
                sub = where / alias.name
                if (sub.with_suffix(".py").exists() or sub.is_dir()) and alias.name not in face:
                    if not sub.is_dir():
                        bypassed.append(f"{name}: from {target} import {alias.name}")
    assert bypassed == [], "\n".join(bypassed)

"""The package's shape: every import goes down the layers of docs/DESIGN.md, no cycles, small files.

Imports are read from the source (top level and inside functions alike), so a
lazy ``from ..interop import x`` inside a method counts as much as one at the top.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "attnlab"
DESIGN = ROOT.parent / "docs" / "DESIGN.md"

# Layer of each module (the longest matching name wins), bottom to top: DESIGN's list,
# as docs/DESIGN.md's layer table writes it (test_the_design_document_states_these_layers
# holds the two equal). A module may import its own layer and the layers below.
LAYERS = {
    "attnlab.checks": 0, "attnlab._tracing": 0, "attnlab.config": 0, "attnlab.io": 0,
    "attnlab._version": 0, "attnlab._pages": 0,
    "attnlab.reference": 1,
    "attnlab.masks": 2, "attnlab.mask_forms": 2, "attnlab.mask_shift": 2, "attnlab.blockmask": 2,
    "attnlab.rope": 3, "attnlab.cache": 3,
    "attnlab.text": 4, "attnlab.viz": 4,
    "attnlab.layouts": 5,
    "attnlab.functional": 6, "attnlab._sdpa": 6, "attnlab._tiled": 6, "attnlab._native": 6,
    "attnlab._flash": 6, "attnlab._decode": 6, "attnlab.backends": 6, "attnlab._eager": 6,
    "attnlab._variants": 6, "attnlab._tiled_mod": 6, "attnlab._fakes": 6, "attnlab._lse": 6,
    "attnlab._arguments": 6,
    "attnlab.distributed": 7,
    "attnlab.modules": 8, "attnlab.compat": 8,
    "attnlab.models": 9,
    "attnlab.checkpoint": 10, "attnlab.training": 10, "attnlab.progress": 10,
    "attnlab.recipe": 10,
    "attnlab.interop": 11,
    "attnlab.experiments": 12, "attnlab.heads": 12,
    "attnlab.lessons": 13, "attnlab.check": 13,
    "attnlab.bench": 14,
    "attnlab.cli": 15, "attnlab.demo": 15, "attnlab.__main__": 15,
}
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT.parent / rel).with_suffix(".py").exists() or (ROOT.parent / rel).is_dir()


def _imports(path: Path) -> set[str]:
    """attnlab modules that ``path`` imports anywhere in its body."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("attnlab"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("attnlab"):
                continue
            for alias in node.names:  # ``from . import masks`` imports a module
                sub = f"{target}.{alias.name}"
                found.add(sub if _is_module(sub) else target)
    found.discard(name)
    return found


def _layer(name: str) -> int | None:
    while name:
        if name in LAYERS:
            return LAYERS[name]
        name = name.rpartition(".")[0]
    return None


SOURCES = sorted(p for p in ROOT.rglob("*.py") if p != ROOT / "__init__.py")


def test_every_module_has_a_layer():
    assert [_module_name(p) for p in SOURCES if _layer(_module_name(p)) is None] == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: _module_name(p))
def test_imports_go_down_the_layers(path):
    name = _module_name(path)
    upward = [(target, _layer(target)) for target in sorted(_imports(path))
              if target != "attnlab" and _layer(target) > _layer(name)]
    assert upward == [], f"{name} (layer {_layer(name)}) imports higher layers: {upward}"


def test_no_import_cycles():
    graph = {_module_name(p): {t for t in _imports(p) if t != "attnlab"} for p in SOURCES}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(node):] + [node])}")
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])


def test_the_package_face_imports_only_what_it_reexports():
    """``attnlab/__init__.py`` is exempt from the layers (it re-exports the public API),
    but nothing inside the package may import it back."""
    assert not [p for p in SOURCES if "attnlab" in _imports(p) and p.name != "__main__.py"]


@pytest.mark.parametrize("path", SOURCES + [ROOT / "__init__.py"], ids=lambda p: _module_name(p))
def test_files_stay_small(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines < MAX_LINES, f"{path.name} has {lines} lines; split it by job"


def _design_layers() -> dict[str, int]:
    """docs/DESIGN.md's layer table as ``{module: layer}``: the rows after the
    ``<!-- layers`` marker, up to the first line that is not a table row."""
    lines = DESIGN.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("<!-- layers"))
    table: dict[str, int] = {}
    for line in lines[start + 1:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not cells[0].isdigit():
            continue  # the header and its rule
        for name in re.findall(r"`([^`]+)`", cells[1]):
            table[f"attnlab.{name.rstrip('/')}"] = int(cells[0])
    return table


def test_the_design_document_states_these_layers():
    """The repository's own design document and this test say the same layers."""
    assert _design_layers() == LAYERS


def test_the_design_document_names_every_top_level_module():
    tops = {p.stem for p in ROOT.glob("*.py") if p.name != "__init__.py"}
    tops |= {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    missing = sorted(f"attnlab.{t}" for t in tops if f"attnlab.{t}" not in _design_layers())
    assert missing == [], f"docs/DESIGN.md's layer table does not name {missing}"

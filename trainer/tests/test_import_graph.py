"""The trainer's package layering (trainer/CONTRACT.md): no import cycle between its packages, and none of
the upward imports the contract forbids. Every `from dflash_trainer.X import` and `import dflash_trainer.X`
line counts, function-level and TYPE_CHECKING imports too."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "dflash_trainer"
IMPORT = re.compile(r"^\s*(?:from\s+dflash_trainer\.([\w.]+)\s+import\b|import\s+dflash_trainer\.([\w.]+))")
# (importer, imported): the runtime never reaches up into the operator harnesses, the method stays pure.
FORBIDDEN = {("distributed", "service"), ("method", "model"), ("train", "distributed"), ("train", "service")}


def package_edges(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the lines, for the packages (directories) of the trainer."""
    packages = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if len(rel.parts) < 2 or rel.parts[0] not in packages:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            m = IMPORT.match(line)
            if m is None:
                continue
            target = (m.group(1) or m.group(2)).split(".")[0]
            if target in packages and target != rel.parts[0]:
                edges.setdefault((rel.parts[0], target), []).append(f"{rel}:{number}")
    return edges


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    found = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                found.append([*path, start])
            elif nxt not in path and nxt > start:
                walk(start, nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return found


def test_no_import_cycle_between_the_trainers_packages() -> None:
    edges = package_edges()
    assert ("service", "distributed") in edges  # the graph is read at all
    found = cycles(edges)
    assert not found, "; ".join(
        " -> ".join(c) + " (" + ", ".join(edges[(c[0], c[1])][:2]) + ")" for c in found
    )


def test_no_forbidden_upward_import() -> None:
    edges = package_edges()
    bad = {edge: lines for edge, lines in edges.items() if edge in FORBIDDEN}
    assert not bad, bad


def test_the_checks_find_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    for package, imports in (("method", "model"), ("model", "method")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "a.py").write_text(f"def f():\n    from dflash_trainer.{imports}.a import f\n")
    edges = package_edges(tmp_path)
    assert cycles(edges) == [["method", "model", "method"]]
    assert ("method", "model") in FORBIDDEN and edges[("method", "model")] == ["method/a.py:2"]

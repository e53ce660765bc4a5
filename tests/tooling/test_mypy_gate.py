"""scripts/mypy_gate.py's arithmetic (the type gate of `make lint`): the errors per file may shrink, never
grow; a rewrite of the baseline refuses growth, or with --allow-moves only growth of the total; mypy's JSON
lines are counted as errors, its notes are not. Small inputs, no mypy run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from lab.settings import REPO

_spec = importlib.util.spec_from_file_location("mypy_gate", REPO / "scripts" / "mypy_gate.py")
assert _spec and _spec.loader
gate = importlib.util.module_from_spec(_spec)
sys.modules["mypy_gate"] = gate  # dataclasses look their module up there
_spec.loader.exec_module(gate)


def record(file: str, line: int = 1, severity: str = "error", code: str | None = "arg-type") -> str:
    """One line of `mypy --output json`, as mypy 2.4 writes it (mypy/error_formatter.py: JSONFormatter)."""
    return json.dumps({
        "file": file, "line": line, "column": 4, "end_line": line, "end_column": 9,
        "message": "Incompatible types", "hint": None, "code": code, "severity": severity,
    })  # fmt: skip


def test_equal_counts_pass_and_name_nothing() -> None:
    verdict = gate.compare({"a.py": 2, "b.py": 1}, {"a.py": 2, "b.py": 1})
    assert verdict.ok and verdict.grew == {} and verdict.shrank == {}


def test_a_count_that_grew_fails_naming_the_file() -> None:
    verdict = gate.compare({"a.py": 2, "b.py": 1}, {"a.py": 3, "b.py": 1})
    assert not verdict.ok
    assert verdict.grew == {"a.py": (2, 3)} and verdict.shrank == {}


def test_a_file_new_to_the_baseline_counts_from_zero() -> None:
    verdict = gate.compare({"a.py": 2}, {"a.py": 2, "new.py": 1})
    assert verdict.grew == {"new.py": (0, 1)}


def test_a_count_that_shrank_passes_and_is_reported() -> None:
    verdict = gate.compare({"a.py": 2, "gone.py": 4}, {"a.py": 1})
    assert verdict.ok
    assert verdict.shrank == {"a.py": (2, 1), "gone.py": (4, 0)}


def test_update_lowers_the_baseline_and_drops_clean_files() -> None:
    assert gate.updated({"a.py": 2, "b.py": 1}, {"a.py": 1}, allow_moves=False) == {"a.py": 1}


def test_update_refuses_growth_naming_the_file() -> None:
    with pytest.raises(ValueError, match=r"b\.py 1 -> 2"):
        gate.updated({"a.py": 2, "b.py": 1}, {"a.py": 1, "b.py": 2}, allow_moves=False)


def test_update_with_moves_takes_errors_moved_between_files() -> None:
    moved = gate.updated({"run.py": 5}, {"run.py": 1, "loop.py": 4}, allow_moves=True)
    assert moved == {"loop.py": 4, "run.py": 1}


def test_update_with_moves_still_refuses_a_larger_total() -> None:
    with pytest.raises(ValueError, match=r"in total, 5 -> 6"):
        gate.updated({"run.py": 5}, {"run.py": 1, "loop.py": 5}, allow_moves=True)


def test_the_first_baseline_is_today_s_counts() -> None:
    assert gate.updated(None, {"a.py": 3}, allow_moves=False) == {"a.py": 3}


def test_errors_are_counted_per_file_and_notes_are_not(tmp_path: Path) -> None:
    lines = [
        record("trainer/src/x.py", 3), record("trainer/src/x.py", 9), record("scripts/y.py"),
        record("trainer/src/x.py", 3, severity="note", code="annotation-unchecked"),
        record(str(tmp_path / "lab" / "z.py")), "",
    ]  # fmt: skip
    errors = gate.parse_errors(lines, tmp_path)
    assert gate.per_file(errors) == {"trainer/src/x.py": 2, "scripts/y.py": 1, "lab/z.py": 1}
    assert str(errors[0]) == "trainer/src/x.py:3: Incompatible types  [arg-type]"


def test_a_line_that_is_not_json_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(gate.GateError, match=r"mypy\.ini: note: unused section"):
        gate.parse_errors(["mypy.ini: note: unused section(s): [mypy-yaml]"], tmp_path)


@pytest.mark.parametrize("text", ['["a.py"]', '{"a.py": -1}', '{"a.py": "2"}', '{"a.py": true}', "{not json"])
def test_a_malformed_baseline_is_refused_naming_it(tmp_path: Path, text: str) -> None:
    path = tmp_path / "mypy-baseline.json"
    path.write_text(text)
    with pytest.raises(gate.GateError, match=r"mypy-baseline\.json"):
        gate.read_baseline(path)


def test_no_baseline_reads_as_none(tmp_path: Path) -> None:
    assert gate.read_baseline(tmp_path / "absent.json") is None

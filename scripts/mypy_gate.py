#!/usr/bin/env python3
"""The type gate of `make lint`: mypy (configured by mypy.ini) over the trainer (trainer/src, against the
trainer's venv) and the operator code (scripts/, lab/, against the tools venv); the errors per file are
compared with mypy-baseline.json (file -> count), a count that only shrinks.

  scripts/mypy_gate.py          fails naming each file whose count grew (a file new to it counts from 0)
  scripts/mypy_gate.py --update rewrites the baseline to today's counts (or writes the first one); refuses
                                if any count grew
  ... --update --allow-moves    the same, except that counts may move between files (code moved by a
                                refactor) as long as the total does not grow

A count rises only by hand: an edit of mypy-baseline.json, in the commit that says why.

Exit status: 0 clean, 1 a count grew (or --update refused), 2 mypy itself failed (a config error, a crash).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "mypy-baseline.json"
CONFIG = ROOT / "mypy.ini"
CACHE = ROOT / "build" / "mypy"  # one cache per run: the two venvs resolve imports differently


@dataclass(frozen=True)
class Run:
    """One mypy invocation: PATHS checked against the packages of the venv whose interpreter is PYTHON."""

    name: str
    python: Path
    paths: tuple[str, ...]


RUNS = (
    Run("trainer", ROOT / ".venv-trainer" / "bin" / "python", ("trainer/src", "lab/seed_trainer.py")),
    Run("tools", ROOT / ".venv" / "bin" / "python", ("scripts", "lab")),
)


class GateError(Exception):
    """mypy could not check the code: its own failure, not a type error."""


@dataclass(frozen=True)
class Verdict:
    grew: dict[str, tuple[int, int]]  # file -> (baseline, now)
    shrank: dict[str, tuple[int, int]]

    @property
    def ok(self) -> bool:
        return not self.grew


def compare(baseline: dict[str, int], now: dict[str, int]) -> Verdict:
    """Per file, the counts that grew and those that shrank; a file absent on one side counts 0 there."""
    grew: dict[str, tuple[int, int]] = {}
    shrank: dict[str, tuple[int, int]] = {}
    for path in sorted(baseline.keys() | now.keys()):
        before, after = baseline.get(path, 0), now.get(path, 0)
        if after > before:
            grew[path] = (before, after)
        elif after < before:
            shrank[path] = (before, after)
    return Verdict(grew, shrank)


def updated(baseline: dict[str, int] | None, now: dict[str, int], allow_moves: bool) -> dict[str, int]:
    """The baseline to write for NOW (the first one when BASELINE is None); ValueError naming what grew when
    that is not allowed."""
    verdict = compare(baseline or {}, now)
    if baseline is not None and verdict.grew:
        total_before, total_now = sum(baseline.values()), sum(now.values())
        named = ", ".join(f"{path} {b} -> {a}" for path, (b, a) in verdict.grew.items())
        if not allow_moves:
            raise ValueError(
                f"mypy errors grew in {named}; fix them (a refactor that only moved code between files: "
                "--update --allow-moves)"
            )
        if total_now > total_before:
            raise ValueError(f"mypy errors grew in total, {total_before} -> {total_now} ({named}); fix them")
    return {path: count for path, count in sorted(now.items()) if count > 0}


@dataclass(frozen=True)
class Error:
    file: str  # relative to the repository, POSIX
    line: int
    message: str
    code: str | None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}" + (f"  [{self.code}]" if self.code else "")


def parse_errors(lines: list[str], root: Path) -> list[Error]:
    """The errors in mypy's `--output json` lines (one record a line); notes are not errors."""
    errors = []
    for line in lines:
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise GateError(f"mypy printed a line that is not a JSON error record: {line!r}") from err
        if item.get("severity") != "error":
            continue
        path = Path(item["file"])
        if path.is_absolute():
            path = path.relative_to(root)
        errors.append(Error(path.as_posix(), int(item["line"]), str(item["message"]), item.get("code")))
    return errors


def per_file(errors: list[Error]) -> dict[str, int]:
    return dict(Counter(e.file for e in errors))


def run_mypy(run: Run) -> list[Error]:
    if importlib.util.find_spec("mypy") is None:
        raise GateError(f"{sys.executable} has no mypy: run the gate with .venv/bin/python (make bootstrap)")
    if not run.python.is_file():
        raise GateError(f"{run.python} is missing: run `make bootstrap` (the {run.name} venv)")
    cmd = [
        sys.executable, "-m", "mypy", "--config-file", str(CONFIG), "--python-executable", str(run.python),
        "--cache-dir", str(CACHE / run.name), "--output", "json", "--no-error-summary", *run.paths,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    # 0: nothing to report, 1: errors or notes (JSON lines on stdout), 2 or another: mypy did not finish.
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not proc.stdout.strip()):
        raise GateError(f"mypy ({run.name}: {' '.join(run.paths)}) exited {proc.returncode}: "
                        f"{(proc.stderr or proc.stdout).strip()}")  # fmt: skip
    return parse_errors(proc.stdout.splitlines(), ROOT)


def read_baseline(path: Path) -> dict[str, int] | None:
    """The counts of PATH; None when there is no baseline yet."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as err:
        raise GateError(f"{path} is not JSON: {err}") from err
    # type(v) is int: a bool is an int too.
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and type(v) is int and v >= 0 for k, v in data.items()
    ):
        raise GateError(f"{path} must map each file to a count of errors (a non-negative integer)")
    return data


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="rewrite the baseline; refused if a count grew")
    parser.add_argument("--allow-moves", action="store_true", help="with --update: counts may change files")
    parser.add_argument("--baseline", type=Path, default=BASELINE, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.allow_moves and not args.update:
        parser.error("--allow-moves goes with --update")
    try:
        baseline = read_baseline(args.baseline)
        errors = [error for run in RUNS for error in run_mypy(run)]
    except GateError as err:
        print(f"mypy_gate: {err}", file=sys.stderr)
        return 2
    now = per_file(errors)
    rel = args.baseline.relative_to(ROOT) if args.baseline.is_relative_to(ROOT) else args.baseline
    if args.update:
        try:
            new = updated(baseline, now, args.allow_moves)
        except ValueError as err:
            print(f"mypy_gate: {rel} not updated: {err}", file=sys.stderr)
            return 1
        args.baseline.write_text(json.dumps(new, indent=2, sort_keys=True) + "\n")
        print(f"mypy_gate: wrote {rel}: {sum(new.values())} errors in {len(new)} files")
        return 0
    if baseline is None:
        print(f"mypy_gate: no {rel}: start one with `scripts/mypy_gate.py --update`", file=sys.stderr)
        return 1
    verdict = compare(baseline, now)
    for path, (before, after) in verdict.grew.items():
        print(f"mypy_gate: {path}: {after} mypy errors, {rel} allows {before}; fix the new:", file=sys.stderr)
        for error in errors:
            if error.file == path:
                print(f"  {error}", file=sys.stderr)
    for path, (before, after) in verdict.shrank.items():
        print(f"mypy_gate: {path}: {before} -> {after} mypy errors; run `scripts/mypy_gate.py --update` "
              f"to lower the baseline")  # fmt: skip
    if verdict.ok:
        print(f"mypy_gate: {sum(now.values())} errors in {len(now)} files, none above {rel}")
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Where the trainer reads a configuration value: every attribute load `.NAME`, subscript `["NAME"]` and
`.get("NAME")` in trainer/src at a git revision, counted by sites and files (docs/journal.md, "Config value
walks": a view beside the walks, which follow a whole parameter).

  python3 scripts/config_readers.py REV [NAME ...] [--sites]     (default names: checkpoint_dir targets)
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from collections.abc import Iterator

ROOT = "trainer/src"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def reads(tree: ast.AST, name: str) -> Iterator[tuple[int, str]]:
    """(line, form) of each read of `name` in `tree`: `attr`, `key` (x["name"]) or `get` (x.get("name"))."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.ctx, ast.Load):
            yield node.lineno, "attr"
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            if node.slice.value == name:
                yield node.lineno, "key"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == name
        ):
            yield node.lineno, "get"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev")
    parser.add_argument("names", nargs="*", default=["checkpoint_dir", "targets"])
    parser.add_argument("--sites", action="store_true", help="list each site")
    args = parser.parse_args(argv)
    files = [f for f in git("ls-tree", "-r", "--name-only", args.rev, ROOT).split() if f.endswith(".py")]
    trees = {f: ast.parse(git("show", f"{args.rev}:{f}"), filename=f) for f in files}
    for name in args.names:
        sites = [(f, line, form) for f, tree in trees.items() for line, form in reads(tree, name)]
        print(f"{args.rev} {name}: {len(sites)} sites in {len({f for f, _l, _k in sites})} files")
        if args.sites:
            for f, line, form in sorted(sites):
                print(f"  {f.removeprefix(ROOT + '/')}:{line} {form}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""layers.yml indexes every tracked file by layer; README.md and docs/*.md link only to what exists.

The checks are functions of a repository root, so the fixture tests below run them on a small git repository
of their own as well as on this one.
"""

from __future__ import annotations

import functools
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
INDEX = "layers.yml"
# Raw measurement files are linked from the docs, not indexed.
UNINDEXED = ("docs/measurements/",)

LAYER_KEYS = ("roles", "playbooks", "verify", "molecule", "role_tests", "runbook", "inventory")
ENTRY_KEYS = (*LAYER_KEYS, "files")
LAYERS = ("L0", "L1", "L2", "L3", "L4", "L5")


class LayersIndexError(ValueError):
    """layers.yml does not have the shape this module reads."""


@dataclass(frozen=True)
class Pattern:
    entry: str  # "L2", "lab", "shared"
    key: str  # "roles", "files", ...
    text: str  # as written in layers.yml
    glob: str  # the path glob it stands for

    def regex(self) -> re.Pattern[str]:
        return _compile(self.glob)


@functools.cache
def _compile(glob: str) -> re.Pattern[str]:
    """`**` crosses path segments, `*` and `?` do not; `DIR/**` also matches DIR itself."""
    suffix = ""
    if glob.endswith("/**"):
        glob, suffix = glob[:-3], "(?:/.*)?"
    out = []
    i = 0
    while i < len(glob):
        if glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif glob[i] == "*":
            out.append("[^/]*")
            i += 1
        elif glob[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return re.compile("".join(out) + suffix + r"\Z")


def _glob_for(key: str, text: str) -> str:
    if key == "roles":
        return f"roles/{text}/**"
    if key == "molecule":
        return f"molecule/{text}/**"
    return text


def _strings(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise LayersIndexError(f"{INDEX}: {where} must be a non-empty list of strings, got {value!r}")
    return value


def load_index(root: Path) -> list[Pattern]:
    """Every pattern of layers.yml, each tagged with its entry and key; a malformed index names its key."""
    path = root / INDEX
    if not path.is_file():
        raise LayersIndexError(f"{path}: missing")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or set(data) != {"layers", "groups", "shared"}:
        raise LayersIndexError(
            f"{INDEX}: top-level keys must be layers, groups and shared, got {sorted(data or {})}"
        )
    layers, groups = data["layers"], data["groups"]
    if not isinstance(layers, dict) or sorted(layers) != list(LAYERS):
        raise LayersIndexError(
            f"{INDEX}: layers must be exactly {', '.join(LAYERS)}, got {sorted(layers or {})}"
        )
    if not isinstance(groups, dict) or not groups:
        raise LayersIndexError(f"{INDEX}: groups must be a non-empty mapping")
    patterns: list[Pattern] = []
    for kind, entries in (("layers", layers), ("groups", groups)):
        for name, entry in entries.items():
            where = f"{kind}.{name}"
            if not isinstance(entry, dict):
                raise LayersIndexError(f"{INDEX}: {where} must be a mapping")
            unknown = set(entry) - {"what", *ENTRY_KEYS}
            if unknown:
                raise LayersIndexError(f"{INDEX}: {where}: unknown keys {sorted(unknown)}")
            if not isinstance(entry.get("what"), str) or not entry["what"]:
                raise LayersIndexError(f"{INDEX}: {where}.what must say what it is")
            required = LAYER_KEYS if kind == "layers" else ()
            absent = [k for k in required if k not in entry]
            if absent:
                raise LayersIndexError(f"{INDEX}: {where}: missing keys {absent}")
            if kind == "groups" and not set(entry) & set(ENTRY_KEYS):
                raise LayersIndexError(f"{INDEX}: {where} names no paths")
            for key in ENTRY_KEYS:
                if key in entry:
                    for text in _strings(entry[key], f"{where}.{key}"):
                        patterns.append(Pattern(name, key, text, _glob_for(key, text)))
    for text in _strings(data["shared"], "shared"):
        patterns.append(Pattern("shared", "shared", text, text))
    return patterns


def tracked_files(root: Path) -> list[str]:
    """The files git tracks under root (symlinks included, as git lists them)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z"], check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise AssertionError(f"{root}: cannot list the tracked files with git: {err}") from err
    return [p for p in out.split("\0") if p]


def files_without_layer(patterns: list[Pattern], files: list[str]) -> list[str]:
    regexes = [p.regex() for p in patterns]
    return [f for f in files if not f.startswith(UNINDEXED) and not any(r.match(f) for r in regexes)]


def patterns_matching_nothing(patterns: list[Pattern], files: list[str]) -> list[str]:
    return [f"{p.entry}.{p.key}: {p.text}" for p in patterns if not any(p.regex().match(f) for f in files)]


# --- relative links in markdown ---

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE = re.compile(r"(`+).+?\1", re.S)
_LINK = re.compile(r"(?<!\!)\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_IMAGE = re.compile(r"\!\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _without_code(text: str) -> str:
    return _CODE.sub("", _FENCE.sub("", text))


def anchors(markdown: str) -> set[str]:
    """GitHub's heading ids: punctuation but `-` and `_` dropped, spaces as `-`, `-N` on repeats."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for heading in _HEADING.findall(_FENCE.sub("", markdown)):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    # An explicit anchor, as a table row has no heading of its own.
    return out | set(re.findall(r'<a id="([\w-]+)"></a>', markdown))


def broken_links(root: Path, documents: list[Path]) -> list[str]:
    """Each relative link (and its #anchor, in a markdown target) that does not resolve, as `FILE: TARGET`."""
    bad: list[str] = []
    for doc in documents:
        text = doc.read_text()
        body = _without_code(text)
        for target in [*_LINK.findall(body), *_IMAGE.findall(body)]:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                continue  # https:, mailto: and the like
            where = f"{doc.relative_to(root)}: {target}"
            path_part, _, fragment = target.partition("#")
            dest = (doc.parent / path_part).resolve() if path_part else doc
            if not dest.exists():
                bad.append(f"{where} (no such file)")
                continue
            if fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text()):
                bad.append(f"{where} (no heading #{fragment} in {dest.relative_to(root)})")
    return bad


def markdown_documents(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


# --- this repository ---


def test_every_tracked_file_belongs_to_a_layer() -> None:
    orphans = files_without_layer(load_index(ROOT), tracked_files(ROOT))
    assert not orphans, (
        f"tracked files that belong to no layer or group of {INDEX} (add each to one, or to `shared`):\n  "
        + "\n  ".join(orphans)
    )


def test_every_path_in_the_index_exists() -> None:
    missing = patterns_matching_nothing(load_index(ROOT), tracked_files(ROOT))
    assert not missing, f"paths in {INDEX} that match no tracked file:\n  " + "\n  ".join(missing)


def test_every_layer_has_its_playbook_and_checks_by_name() -> None:
    for pattern in load_index(ROOT):
        if pattern.entry in LAYERS and pattern.key in ("playbooks", "verify"):
            number = pattern.entry[1]
            stem = Path(pattern.text).name
            where = f"{INDEX}: {pattern.entry}.{pattern.key}: {pattern.text}"
            assert re.match(rf"(test_)?l{number}_", stem), f"{where} is not named for layer {pattern.entry}"


def test_relative_links_in_readme_and_docs_resolve() -> None:
    bad = broken_links(ROOT, markdown_documents(ROOT))
    assert not bad, "relative links that do not resolve:\n  " + "\n  ".join(bad)


# --- the checks themselves, on a fixture repository ---

FIXTURE_INDEX = """\
layers:
  L0: &layer
    what: w
    roles: [r0]
    playbooks: [ansible/l0.yml]
    verify: [tests/verify/test_l0.py]
    molecule: [m0]
    role_tests: [tests/l0_l1_host/**]
    runbook: [docs/host.md]
    inventory: [inventory/*/group_vars/all/k.yml]
  L1: *layer
  L2: *layer
  L3: *layer
  L4: *layer
  L5: *layer
groups:
  tooling:
    what: t
    files: [layers.yml, scripts/*.py]
shared: [.gitignore]
"""

FIXTURE_FILES = (
    "layers.yml",
    ".gitignore",
    "roles/r0/tasks/main.yml",
    "ansible/l0.yml",
    "tests/verify/test_l0.py",
    "molecule/m0/molecule.yml",
    "tests/l0_l1_host/test_x.py",
    "docs/host.md",
    "docs/measurements/2026-01-01/raw.log",
    "inventory/lab/group_vars/all/k.yml",
    "scripts/a.py",
)


def _git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
    )


@pytest.fixture
def fixture_repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    for name in FIXTURE_FILES:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(FIXTURE_INDEX if name == "layers.yml" else "x\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "fixture")
    return tmp_path


def test_fixture_is_complete(fixture_repo: Path) -> None:
    patterns = load_index(fixture_repo)
    files = tracked_files(fixture_repo)
    assert files_without_layer(patterns, files) == []
    assert patterns_matching_nothing(patterns, files) == []


def test_a_tracked_file_of_no_layer_is_named(fixture_repo: Path) -> None:
    (fixture_repo / "scripts/deploy.sh").write_text("x\n")
    patterns = load_index(fixture_repo)
    assert files_without_layer(patterns, tracked_files(fixture_repo)) == []  # untracked: not yet
    _git(fixture_repo, "add", "scripts/deploy.sh")
    assert files_without_layer(patterns, tracked_files(fixture_repo)) == ["scripts/deploy.sh"]


def test_star_stays_in_one_segment(fixture_repo: Path) -> None:
    (fixture_repo / "scripts/sub").mkdir()
    (fixture_repo / "scripts/sub/b.py").write_text("x\n")
    _git(fixture_repo, "add", "scripts/sub/b.py")
    orphans = files_without_layer(load_index(fixture_repo), tracked_files(fixture_repo))
    assert orphans == ["scripts/sub/b.py"]


def test_a_path_in_the_index_that_is_gone_is_named(fixture_repo: Path) -> None:
    _git(fixture_repo, "rm", "-q", "ansible/l0.yml", "molecule/m0/molecule.yml")
    missing = patterns_matching_nothing(load_index(fixture_repo), tracked_files(fixture_repo))
    assert "L0.playbooks: ansible/l0.yml" in missing
    assert "L0.molecule: m0" in missing


def test_a_malformed_index_names_its_key(fixture_repo: Path) -> None:
    (fixture_repo / "layers.yml").write_text(
        FIXTURE_INDEX.replace("    molecule: [m0]\n", "    molecule: m0\n")
    )
    with pytest.raises(LayersIndexError, match=r"layers\.L0\.molecule must be a non-empty list"):
        load_index(fixture_repo)
    (fixture_repo / "layers.yml").write_text(FIXTURE_INDEX.replace("  L5: *layer\n", ""))
    with pytest.raises(LayersIndexError, match="layers must be exactly L0, L1, L2, L3, L4, L5"):
        load_index(fixture_repo)


def test_broken_links_and_anchors_are_named(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/a.md").write_text(
        "# A\n\n## When a check fails: `make verify`\n\n```sh\n# not a heading\n```\n"
        '| <a id="a-row"></a>a row | 1 |\n'
    )
    readme = tmp_path / "README.md"
    readme.write_text(
        "[ok](docs/a.md) [ok](docs/a.md#when-a-check-fails-make-verify) [web](https://example.org/x)\n"
        "[ok](docs/a.md#a-row)\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#not-a-heading) `[in code](docs/c.md)`\n"
        "```\n[fenced](docs/d.md)\n```\n"
    )
    assert broken_links(tmp_path, [readme]) == [
        "README.md: docs/b.md (no such file)",
        "README.md: docs/a.md#not-a-heading (no heading #not-a-heading in docs/a.md)",
    ]

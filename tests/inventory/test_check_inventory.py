"""scripts/check_inventory.py, which `make provision` (and verify, smoke-train, logs) runs before any play:
one line naming the file for a YAML syntax error (with its line) and for a vault file in plain text.
CPU-only: copies of the repository's inventories under tmp_path; the lab is never touched."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lab.settings import REPO

CHECK = REPO / "scripts" / "check_inventory.py"
BIN = Path(sys.executable).parent


def check(inventory: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "ANSIBLE_VAULT_PASSWORD_FILE"}
    return subprocess.run(
        [sys.executable, str(CHECK), str(inventory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**base, **env},
    )


def copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(REPO / "inventory" / name, tmp_path / name))


def test_the_lab_inventory_passes(tmp_path: Path) -> None:
    proc = check(copy("lab", tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


def test_the_example_is_refused_until_its_vault_is_encrypted(tmp_path: Path) -> None:
    inv = copy("example", tmp_path)
    vault = inv / "group_vars" / "all" / "vault.yml"
    proc = check(inv)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"{vault} is not encrypted" in lines[0]
    assert f"ansible-vault encrypt {vault}" in lines[0]


def encrypt_vault(vault: Path, tmp_path: Path) -> Path:
    """Encrypts VAULT in place with a lab-only password; returns the password file (0600)."""
    password = tmp_path / "vault-pass"
    password.write_text("lab-only-password\n")
    password.chmod(0o600)
    subprocess.run(
        [str(BIN / "ansible-vault"), "encrypt", "--vault-password-file", str(password), str(vault)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return password


def test_an_encrypted_vault_passes_with_its_password_and_is_named_without(tmp_path: Path) -> None:
    inv = copy("example", tmp_path)
    vault = inv / "group_vars" / "all" / "vault.yml"
    password = encrypt_vault(vault, tmp_path)
    assert vault.read_text().startswith("$ANSIBLE_VAULT;")
    proc = check(inv, ANSIBLE_VAULT_PASSWORD_FILE=str(password))
    assert proc.returncode == 0, proc.stderr
    proc = check(inv)
    assert proc.returncode == 1
    assert "vault files are encrypted and no vault password was given" in proc.stderr
    assert "ANSIBLE_VAULT_PASSWORD_FILE" in proc.stderr


def test_a_plain_vault_in_host_vars_is_refused(tmp_path: Path) -> None:
    inv = copy("lab", tmp_path)
    vault = inv / "host_vars" / "lab-ct200" / "vault.yaml"
    vault.parent.mkdir(parents=True)
    vault.write_text("---\nvault_wandb_api_key: not-yet-encrypted\n")
    proc = check(inv)
    assert proc.returncode == 1
    assert f"{vault} is not encrypted" in proc.stderr
    assert "not-yet-encrypted" not in proc.stderr  # the secret itself is never printed


@pytest.mark.parametrize(
    ("relative", "text", "line"),
    [
        ("group_vars/all/data.yml", "---\nfirst: 1\nsecond: [1, 2\nthird: 3\n", 4),
        ("hosts.yml", "all:\n  hosts:\n    lab-ct200: a: b\n", 3),
        ("group_vars/training_cts/service.yml", '---\nkey: "unterminated\n', 3),
    ],
)
def test_a_yaml_syntax_error_names_the_file_and_line(
    tmp_path: Path, relative: str, text: str, line: int
) -> None:
    inv = copy("lab", tmp_path)
    broken = inv / relative
    broken.write_text(text)
    proc = check(inv)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"{broken} line {line}," in lines[0], lines[0]
    assert "YAML syntax error" in lines[0]
    assert "cannot be parsed" not in lines[0]


def test_ansibles_own_tags_are_not_syntax_errors(tmp_path: Path) -> None:
    inv = copy("lab", tmp_path)
    extra = inv / "group_vars" / "all" / "tags.yml"
    extra.write_text("---\nliteral_braces: !unsafe '{{ not a template }}'\n")
    proc = check(inv)
    assert proc.returncode == 0, proc.stderr

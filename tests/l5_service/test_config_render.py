"""The deployed train.toml and the rank count (roles/trainer_service/filter_plugins/dflash_train_config.py):
the reference run with the inventory's named keys replaced, [topology] the one source of the rank count,
and `make provision`'s inventory check refusing a mismatch before it touches a host. No lab needed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
REFERENCE = (REPO / "trainer/configs/reference.toml").read_text()
spec = importlib.util.spec_from_file_location(
    "dflash_train_config", REPO / "roles/trainer_service/filter_plugins/dflash_train_config.py"
)
assert spec is not None and spec.loader is not None
render = importlib.util.module_from_spec(spec)
spec.loader.exec_module(render)


def test_named_keys_replace_the_reference_and_null_removes_one() -> None:
    tables = render.merge(REFERENCE, {"drafter": {"num_layers": 2, "head_dim": None}, "new": {"k": 1}})
    ref = tomllib.loads(REFERENCE)
    assert tables["drafter"]["num_layers"] == 2 and "head_dim" not in tables["drafter"]
    assert tables["drafter"]["mask_token_id"] == ref["drafter"]["mask_token_id"]  # not named: the reference's
    assert tables["train"] == ref["train"] and tables["new"] == {"k": 1}
    assert tomllib.loads(render.to_toml(tables)) == tables  # the rendered file reads back the same


def test_topology_is_the_rank_count_and_mismatches_name_the_three_values() -> None:
    ref = render.merge(REFERENCE)
    assert render.ranks(ref) == 8 and render.rank_problems(ref, list(range(8))) == []
    [problem] = render.rank_problems(ref, [0, 1, 2, 3])
    assert "[topology] 4 targets + 4 drafters = 8 ranks" in problem and "ct_gpus 4 GPU(s)" in problem
    assert "trainer_service_nproc 8 (derived)" in problem
    stale = render.rank_problems(ref, list(range(8)), 4)
    assert (
        stale and "trainer_service_nproc 4 (set)" in stale[0] and "remove trainer_service_nproc" in stale[0]
    )
    auto = render.merge(REFERENCE, {"topology": {"drafters": "auto"}})
    assert "integers" in render.rank_problems(auto, [])[0]
    cpu = render.merge(REFERENCE, {"topology": {"targets": 1, "drafters": 1}, "train": {"device": "cpu"}})
    assert render.rank_problems(cpu, []) == []  # the lab: two ranks on CPU, no GPU
    cuda = render.merge(REFERENCE, {"topology": {"targets": 1, "drafters": 1}})
    assert "train.device is cuda but the CT gets no GPU" in render.rank_problems(cuda, [])[0]


def test_the_lab_starts_two_ranks_of_the_reference_run() -> None:
    lab = yaml.safe_load((REPO / "inventory/lab/group_vars/training_cts/service.yml").read_text())
    tables = render.merge(REFERENCE, lab["trainer_service_config"])
    assert render.ranks(tables) == 2
    assert tables["optim"]["lr"] == tomllib.loads(REFERENCE)["optim"]["lr"]  # the reference's, not a copy


def test_the_inventory_check_refuses_a_mismatch_before_any_host(tmp_path: Path) -> None:
    check = [sys.executable, str(REPO / "scripts/check_inventory.py")]
    inv = tmp_path / "inv"
    subprocess.run(["cp", "-r", str(REPO / "inventory/example"), str(inv)], check=True)
    # A real inventory's vault is encrypted (the check refuses a plain one): encrypt the copy's placeholders.
    password = tmp_path / "vault-password"
    password.write_text("lab-test\n")
    password.chmod(0o600)
    vault = [
        str(Path(sys.executable).parent / "ansible-vault"),
        "encrypt",
        "--vault-password-file",
        str(password),
    ]
    subprocess.run([*vault, str(inv / "group_vars/all/vault.yml")], check=True, capture_output=True)
    env = os.environ | {"ANSIBLE_VAULT_PASSWORD_FILE": str(password)}
    ok = subprocess.run([*check, str(inv)], capture_output=True, text=True, check=False, env=env)
    assert ok.returncode == 0, ok.stderr
    container = inv / "group_vars/all/container.yml"
    container.write_text(
        container.read_text().replace("ct_gpus: [0, 1, 2, 3, 4, 5, 6, 7]", "ct_gpus: [0, 1]")
    )
    proc = subprocess.run([*check, str(inv)], capture_output=True, text=True, check=False, env=env)
    assert proc.returncode == 1
    # The example's two CTs form one job (group training_job): each holds half of its 16 ranks.
    said = "[topology] 8 targets + 8 drafters = 16 ranks (8 on each of 2 CTs)"
    assert said in proc.stderr and "ct_gpus 2 GPU(s)" in proc.stderr, proc.stderr

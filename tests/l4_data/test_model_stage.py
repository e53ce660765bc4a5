"""dflash-stage-model and its unit in the container: restaged after a "reboot" (an emptied /dev/shm), a no-op
when valid, a truncated or corrupt copy restaged, too small a /dev/shm refused before copying, wrong or
malformed manifests one clear error with nothing left half-written."""

from __future__ import annotations

import json

from tests.l4_data import s3data
from tests.l4_data.conftest import SHM_WORK, STAGE, converge_l4, ct, ct_ok

UNIT = "dflash-stage-model.service"


def unit_argv() -> list[str]:
    value = ct_ok(f"systemctl show {UNIT} -p ExecStart --value")
    return value.split("argv[]=")[1].split(" ;")[0].split()


def dest() -> str:
    argv = unit_argv()
    return argv[argv.index("--dest") + 1]


def test_unit_and_settings_file_agree(converged) -> None:
    """The unit spells its settings out; the trainer's ExecStartPre and L4's check read the file: the same."""
    argv = unit_argv()
    settings = json.loads(ct_ok("cat /etc/dflash/stage-model.json"))
    flags = {
        key: argv[argv.index(f"--{key}") + 1] for key in ("source", "dest", "manifest", "verify", "workers")
    }
    assert {key: str(value) for key, value in settings.items()} == flags


def staged_all() -> str:
    """The staging tool's line for a full restage: every file of the store's manifest."""
    argv = unit_argv()
    source, name = (argv[argv.index(flag) + 1] for flag in ("--source", "--manifest"))
    path = (
        name if name.startswith("/") else f"{source}/{name}"
    )  # relative to the source, as the tool reads it
    return f"staged {len(json.loads(ct_ok(f'cat {path}'))['files'])} files"


def journal_since(cursor: str) -> str:
    return ct_ok(f"journalctl -u {UNIT} -o cat --no-pager --after-cursor='{cursor}'")


def cursor() -> str:
    return ct_ok("journalctl -n 0 --show-cursor --no-pager | sed -n 's/^-- cursor: //p'").strip()


def test_reboot_restages_the_model(converged) -> None:
    """A reboot empties /dev/shm; the unit (WantedBy=multi-user.target) stages the model again."""
    staged = dest()
    ct_ok(f"rm -rf {staged} {staged}.staging-*")
    mark = cursor()
    ct_ok(f"systemctl restart {UNIT}")
    assert staged_all() in journal_since(mark)
    assert ct(shell_join([*unit_argv(), "--check", "--verify", "full"])).returncode == 0


def test_valid_copy_is_left_alone(converged) -> None:
    inode = ct_ok(f"stat -c %i {dest()}/model.safetensors")
    mark = cursor()
    ct_ok(f"systemctl restart {UNIT}")
    assert "nothing to do" in journal_since(mark)
    assert ct_ok(f"stat -c %i {dest()}/model.safetensors") == inode


def test_truncated_staged_file_is_restaged(converged) -> None:
    ct_ok(f"truncate -s 100 {dest()}/model.safetensors")
    mark = cursor()
    ct_ok(f"systemctl restart {UNIT}")
    log = journal_since(mark)
    assert "model.safetensors: size 100, the manifest says" in log and staged_all() in log
    assert ct(shell_join([*unit_argv(), "--check", "--verify", "full"])).returncode == 0


def test_full_check_finds_a_corrupt_staged_copy(converged) -> None:
    ct_ok(f"printf Z | dd of={dest()}/model.safetensors bs=1 seek=200 conv=notrunc status=none")
    assert ct(shell_join([*unit_argv(), "--check"])).returncode == 0  # a size check cannot see it
    proc = ct(shell_join([*unit_argv(), "--verify", "full"]))
    assert proc.returncode == 0, proc.stderr
    assert "sha256 differs from the manifest" in proc.stdout and staged_all() in proc.stdout


def test_provision_hashes_the_staged_copy_and_restages_a_flipped_byte(converged) -> None:
    """L4 (the play `make provision TAGS=l4` runs) compares contents, not sizes: a byte flipped in the staged
    model is found, the file is named, the model restaged; the next run changes nothing."""
    ct_ok(f"printf Z | dd of={dest()}/model.safetensors bs=1 seek=200 conv=notrunc status=none")
    proc = converge_l4()
    assert proc.returncode == 0, proc.stdout[-3000:]
    said = " ".join(proc.stdout.split())  # the YAML result format folds long lines
    assert f"{dest()}/model.safetensors: sha256 differs from the manifest" in said, proc.stdout[-3000:]
    assert staged_all() in said
    assert ct(shell_join([*unit_argv(), "--check", "--verify", "full"])).returncode == 0
    again = converge_l4()
    assert again.returncode == 0 and "changed=0" in again.stdout.split("PLAY RECAP")[-1], again.stdout[-2000:]


def test_staging_prints_progress_while_it_copies(work: str) -> None:
    """A long copy says how far it is at least every 10 s (the period made short here)."""
    size = 64 << 20
    ct_ok(f"mkdir -p {work}/big && head -c {size} /dev/urandom > {work}/big/weights.bin")
    digest = ct_ok(f"sha256sum {work}/big/weights.bin").split()[0]
    manifest = {"version": 1, "files": [{"path": "weights.bin", "size": size, "sha256": digest}]}
    ct_ok(f"echo '{json.dumps(manifest)}' > {work}/big/MANIFEST.json")
    proc = ct(f"DFLASH_STAGE_PROGRESS_S=0.05 {STAGE} --source {work}/big --dest {SHM_WORK}/model --workers 1")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if f"copying {work}/big to {SHM_WORK}/model:" in line]
    assert lines and "of 64.0 MiB" in lines[-1], proc.stdout


def test_settings_file_errors_are_one_line(work: str) -> None:
    ct_ok(f"echo '{{\"dest\": 5}}' > {work}/stage.json")
    proc = ct(f"{STAGE} --config {work}/stage.json")
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"dflash-stage-model: error: {work}/stage.json: dest must be a str, got 5"
    proc = ct(f"{STAGE} --config {work}/missing.json")
    assert proc.stderr.strip() == (
        f"dflash-stage-model: error: {work}/missing.json: "
        "no such file (written by roles/model_stage, layer L4)"
    )


def test_too_small_dev_shm_is_refused_before_copying(work: str) -> None:
    free = int(ct_ok("df -B1 --output=avail /dev/shm | tail -1"))
    size = free + (64 << 20)
    ct_ok(f"mkdir -p {work}/big && truncate -s {size} {work}/big/weights.bin")  # sparse: no disk used
    manifest = {"version": 1, "files": [{"path": "weights.bin", "size": size, "sha256": "0" * 64}]}
    ct_ok(f"echo '{json.dumps(manifest)}' > {work}/big/MANIFEST.json")
    proc = ct(f"{STAGE} --source {work}/big --dest {SHM_WORK}/model")
    assert proc.returncode == 1
    line = proc.stderr.strip()
    assert "\n" not in line
    assert line.startswith("dflash-stage-model: error: /dev/shm is too small")
    assert f"the model needs {size / 2**20:.1f} MiB ({size} bytes)" in line
    assert "free of" in line and "nothing was copied" in line
    assert ct(f"ls -d {SHM_WORK}/model* 2>/dev/null").stdout == ""


def test_wrong_checksum_leaves_nothing_half_written(work: str) -> None:
    files = s3data.model_files()
    store = f"{work}/store"
    ct_ok(f"mkdir -p {store}")
    for name, data in files.items():
        ct_ok(
            f"python3 -c 'import sys; open(sys.argv[1], \"wb\").write(bytes.fromhex(sys.argv[2]))' "
            f"{store}/{name} {data.hex()}"
        )
    manifest = s3data.manifest_of(s3data.SEED_DIR / "model")
    manifest["files"][1]["sha256"] = "f" * 64
    ct_ok(f"echo '{json.dumps(manifest)}' > {store}/MANIFEST.json")
    proc = ct(f"{STAGE} --source {store} --dest {SHM_WORK}/model")
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"dflash-stage-model: error: {store}/model.safetensors: sha256 differs from {store}/MANIFEST.json "
        "(the store is corrupt or the manifest is wrong); nothing was staged"
    )
    assert ct(f"ls -d {SHM_WORK}/model* 2>/dev/null").stdout == ""


def test_malformed_manifest_is_one_clear_error(work: str) -> None:
    ct_ok(f"mkdir -p {work}/bad && echo '{{\"files\": [' > {work}/bad/MANIFEST.json")
    proc = ct(f"{STAGE} --source {work}/bad --dest {SHM_WORK}/model")
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"dflash-stage-model: error: {work}/bad/MANIFEST.json: not JSON")
    ct_ok(
        f'echo \'{{"version": 1, "files": [{{"path": "../x", "size": 1, "sha256": ""}}]}}\' '
        f"> {work}/bad/MANIFEST.json"
    )
    proc = ct(f"{STAGE} --source {work}/bad --dest {SHM_WORK}/model")
    assert "files[0].path '../x' is not a relative path inside the directory" in proc.stderr


def test_missing_store_file_is_named(work: str) -> None:
    manifest = s3data.manifest_of(s3data.SEED_DIR / "model")
    ct_ok(f"mkdir -p {work}/partial && echo '{json.dumps(manifest)}' > {work}/partial/MANIFEST.json")
    proc = ct(f"{STAGE} --source {work}/partial --dest {SHM_WORK}/model")
    assert proc.returncode == 1
    assert f"model store {work}/partial does not match" in proc.stderr
    assert f"{work}/partial/config.json: missing" in proc.stderr


def shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def shell_join(argv: list[str]) -> str:
    return " ".join(shell_quote(a) for a in argv)


def test_the_staged_model_is_readable_whatever_the_callers_umask(work: str) -> None:
    """The trainer runs as its own user: a copy staged from a shell with umask 077 (lxc-attach, ansible's
    command) must still be a 0755 directory of 0644 files."""
    store = f"{work}/store"
    ct_ok(f"mkdir -p {store}/sub && echo w > {store}/sub/w.bin && echo c > {store}/config.json")
    manifest = ct_ok(f"cd {store} && sha256sum sub/w.bin config.json")
    files = [
        {"path": name, "size": 2, "sha256": digest}
        for digest, name in (line.split() for line in manifest.splitlines())
    ]
    ct_ok(f"echo '{json.dumps({'version': 1, 'files': files})}' > {store}/MANIFEST.json")
    ct_ok(f"umask 077 && {STAGE} --source {store} --dest {SHM_WORK}/model")
    modes = ct_ok(f"cd {SHM_WORK} && stat -c '%a %n' . model model/sub model/sub/w.bin model/MANIFEST.json")
    assert modes.split() == [
        "755",
        ".",
        "755",
        "model",
        "755",
        "model/sub",
        "644",
        "model/sub/w.bin",
        "644",
        "model/MANIFEST.json",
    ], modes

"""The lab's data: a tiny random hybrid target and target-regenerated Arrow shards, made by the trainer's own
code (lab/seed_trainer.py, one process), deterministic from the inventory's seed, and pushed to the lab bucket
with the real awscli. The seed directory is named after the seed and the recipe (RECIPE), so a change of
either makes a new seed."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from lab.errors import LabError
from lab.progress import heartbeat, say
from lab.seed_trainer import NUM_SHARDS
from lab.services import secret, write_secret
from lab.settings import REPO, LabSettings

TRAINER_PYTHON = REPO / ".venv-trainer" / "bin" / "python"
MODEL_PREFIX = "models/tiny-qwen3_5/"
SHARDS_PREFIX = "shards/"
# Bump when lab/seed_trainer.py makes different data from the same seed (r3: 64-token rows, one batch per
# shard, no mask token in the continuation, this tree's trainer).
RECIPE = "r3"


def aws_env(settings: LabSettings) -> dict[str, str]:
    """awscli reads the lab's keys from a root-only credentials file, never from its command line."""
    creds = settings.secrets_dir / "aws-credentials"
    key_id, key = secret(settings, "s3_access_key_id"), secret(settings, "s3_secret_access_key")
    content = f"[default]\naws_access_key_id = {key_id}\naws_secret_access_key = {key}\n"
    if not creds.exists() or creds.read_text() != content:  # written once, not before every aws call
        write_secret(creds, content)
    return {
        **os.environ,
        "AWS_SHARED_CREDENTIALS_FILE": str(creds),
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": "/dev/null",
    }


def aws(settings: LabSettings, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [str(REPO / ".venv" / "bin" / "aws"), "--endpoint-url", settings.s3_endpoint, *args]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=aws_env(settings), check=False, timeout=600
    )
    if check and proc.returncode != 0:
        raise LabError(f"aws {' '.join(args)}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return proc


def seed_dirs(settings: LabSettings) -> tuple[Path, Path]:
    base = settings.lab_dir / "seed" / f"seed-{settings.seed}-{RECIPE}"
    return base / "model", base / "shards"


def ensure_seed_files(settings: LabSettings) -> bool:
    """Makes the seed when missing: into a .partial directory renamed at the end, so a half-made seed is
    never taken as done. Streams the seeding's progress lines; about 30 s on a quiet 2-core machine."""
    model, _shards = seed_dirs(settings)
    final = model.parent
    if final.exists():
        return False
    if not TRAINER_PYTHON.exists():
        raise LabError(f"{TRAINER_PYTHON} is missing: run `make bootstrap` first")
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    say(f"lab: seeding the tiny target and {NUM_SHARDS} shards from lab_seed {settings.seed}")
    with heartbeat("seeding the tiny target and shards"):
        proc = subprocess.run(
            [
                str(TRAINER_PYTHON),
                "-m",
                "lab.seed_trainer",
                str(partial / "model"),
                str(partial / "shards"),
                str(settings.seed),
            ],
            cwd=REPO,
            stdout=None,  # its progress lines go to the console as they come
            stderr=subprocess.PIPE,  # library noise stays out; its last line names a fault
            text=True,
            env={
                **os.environ,
                # This tree's trainer, whichever checkout the venv's editable install points at.
                "PYTHONPATH": str(REPO / "trainer" / "src"),
                "OMP_NUM_THREADS": "1",
                "TQDM_DISABLE": "1",
                "PYTHONUNBUFFERED": "1",
            },
            timeout=900,
            check=False,
        )
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise LabError(f"seeding the lab (python -m lab.seed_trainer) failed: {last[0]}")
    # Seeds of another lab_seed or recipe stay (a few MB; lab-down removes them): a checkout of other code
    # finds its own seed and only syncs it, instead of minutes of seeding again.
    partial.rename(final)
    return True


def ensure_bucket(settings: LabSettings) -> bool:
    changed = False
    if aws(settings, "s3api", "head-bucket", "--bucket", settings.s3_bucket, check=False).returncode != 0:
        aws(settings, "s3api", "create-bucket", "--bucket", settings.s3_bucket)
        changed = True
    model, shards = seed_dirs(settings)
    for local, prefix in ((model, MODEL_PREFIX), (shards, SHARDS_PREFIX)):
        out = aws(
            settings,
            "s3",
            "sync",
            "--no-progress",
            "--delete",
            str(local),
            f"s3://{settings.s3_bucket}/{prefix}",
        ).stdout
        changed = changed or bool(out.strip())
    return write_manifest_digests(settings) or changed


def digests_dir(settings: LabSettings) -> Path:
    return settings.lab_dir / "digests"


def write_manifest_digests(settings: LabSettings) -> bool:
    """The sha256 of each manifest just pushed, which inventory/lab pins (shard_sync_manifest_sha256,
    model_stage_manifest_sha256 read these files): the pins follow the seed, and the bucket never vouches
    for itself. Returns whether a digest changed."""
    model, shards = seed_dirs(settings)
    changed = False
    for name, local in (("model", model), ("shards", shards)):
        digest = hashlib.sha256((local / "MANIFEST.json").read_bytes()).hexdigest()
        path = digests_dir(settings) / f"{name}_manifest_sha256"
        if not path.exists() or path.read_text() != digest + "\n":
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(digest + "\n")
            tmp.replace(path)
            changed = True
    return changed


def bucket_listing(settings: LabSettings) -> list[str]:
    proc = aws(settings, "s3", "ls", "--recursive", f"s3://{settings.s3_bucket}/", check=False)
    return (
        [line.split()[-1] for line in proc.stdout.splitlines() if line.strip()]
        if proc.returncode == 0
        else []
    )

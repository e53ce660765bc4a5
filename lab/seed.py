"""The lab's data: a tiny random hybrid target and target-regenerated Arrow shards, made by the trainer's own
CLI, deterministic from the inventory's seed, and pushed to the lab bucket with the real awscli."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from lab.errors import LabError
from lab.services import secret, write_secret
from lab.settings import REPO, LabSettings

TRAINER_CLI = REPO / ".venv-trainer" / "bin" / "dflash-train"
MODEL_PREFIX = "models/tiny-qwen3_5/"
SHARDS_PREFIX = "shards/"
NUM_SHARDS = 4


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


def _trainer(*args: str) -> None:
    if not TRAINER_CLI.exists():
        raise LabError(f"{TRAINER_CLI} is missing: run `make bootstrap` first")
    proc = subprocess.run([str(TRAINER_CLI), *args], capture_output=True, text=True, check=False, timeout=900)
    if proc.returncode != 0:
        raise LabError(
            f"dflash-train {' '.join(args)}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
        )


def _build_once(final: Path, build) -> bool:
    """Runs build(tmp_dir) and renames the result into place: a half-made seed is never taken as done."""
    if final.exists():
        return False
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    build(partial)
    partial.rename(final)
    return True


def seed_dirs(settings: LabSettings) -> tuple[Path, Path]:
    base = settings.lab_dir / "seed" / f"seed-{settings.seed}"
    return base / "model", base / "shards"


def ensure_seed_files(settings: LabSettings) -> bool:
    model, shards = seed_dirs(settings)
    seed = str(settings.seed)

    def build_model(out: Path) -> None:
        _trainer("model", "tiny", str(out), "--kind", "qwen3_5", "--seed", seed)
        _trainer("manifest", str(out))

    def build_shards(out: Path) -> None:
        _trainer(
            "data",
            "synth",
            "--target",
            str(model),
            "--out",
            str(out),
            "--shards",
            str(NUM_SHARDS),
            "--seed",
            seed,
        )
        _trainer("manifest", str(out))

    changed = _build_once(model, build_model)
    return _build_once(shards, build_shards) or changed


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
    return changed


def bucket_listing(settings: LabSettings) -> list[str]:
    proc = aws(settings, "s3", "ls", "--recursive", f"s3://{settings.s3_bucket}/", check=False)
    return (
        [line.split()[-1] for line in proc.stdout.splitlines() if line.strip()]
        if proc.returncode == 0
        else []
    )

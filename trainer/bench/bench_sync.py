"""Benchmark: our shard sync (roles/shard_sync/files/dflash_s3_sync.py) against plain `aws s3 sync`.

    .venv/bin/python trainer/bench/bench_sync.py     # the lab's moto S3 on loopback, 400 MiB in 16 shards

Both run the same awscli against the same server and prefix, into fresh directories, alternately, --repeat
times; then each runs once more over its complete copy (the no-op case). Printed: seconds (best and median)
and the ratio plain/ours (>= 1.0: ours is as fast or faster), while ours also checks every shard's sha256
against the manifest and plain checks nothing. Ours runs with the awscli configuration the role writes
(max_concurrent_requests 16, 16 MB parts); plain with awscli's defaults (10, 8 MB), as `aws s3 sync` runs
when nobody tunes it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "roles" / "shard_sync" / "files" / "dflash_s3_sync.py"


def run(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"bench_sync: {argv[0]} failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return elapsed


def make_shards(directory: Path, total_mib: int, count: int, seed: int) -> None:
    rng = random.Random(seed)
    size = (total_mib << 20) // count
    entries = []
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        data = rng.randbytes(size)
        name = f"shard-{i:05d}.arrow"
        (directory / name).write_bytes(data)
        entries.append({"path": name, "size": size, "sha256": hashlib.sha256(data).hexdigest()})
    (directory / "MANIFEST.json").write_text(json.dumps({"version": 1, "files": entries}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint-url", default="http://127.0.0.1:7480")
    parser.add_argument("--region", default="us-east-1")
    parser.add_argument("--bucket", default="dflash-l4-bench")
    parser.add_argument("--size-mib", type=int, default=400)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--aws", default=str(REPO / ".venv" / "bin" / "aws"))
    parser.add_argument("--credentials-file", default="/var/lib/dflash-lab/secrets/aws-credentials")
    parser.add_argument(
        "--work", default="/var/tmp", help="where the copies are written (a disk, as in CT 200)"
    )
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="dflash-bench-sync-", dir=args.work))
    tuned = work / "aws-config"
    tuned.write_text(
        f"[default]\nregion = {args.region}\ns3 =\n  max_concurrent_requests = 16\n"
        "  multipart_threshold = 16MB\n  multipart_chunksize = 16MB\n"
    )
    base_env = {
        **os.environ,
        "AWS_SHARED_CREDENTIALS_FILE": args.credentials_file,
        "AWS_DEFAULT_REGION": args.region,
    }
    plain_env = {**base_env, "AWS_CONFIG_FILE": "/dev/null"}
    ours_env = {**base_env, "AWS_CONFIG_FILE": str(tuned)}
    aws = [args.aws, "--endpoint-url", args.endpoint_url]
    prefix = f"s3://{args.bucket}/shards-{args.size_mib}m-{args.shards}/"
    try:
        if (
            subprocess.run(
                [*aws, "s3api", "head-bucket", "--bucket", args.bucket],
                env=plain_env,
                capture_output=True,
                check=False,
            ).returncode
            != 0
        ):
            run([*aws, "s3api", "create-bucket", "--bucket", args.bucket], plain_env)
        listed = subprocess.run(
            [*aws, "s3", "ls", prefix], env=plain_env, capture_output=True, text=True, check=False
        )
        if listed.stdout.count(".arrow") != args.shards:
            make_shards(work / "seed", args.size_mib, args.shards, seed=4)
            seconds = run(
                [*aws, "s3", "sync", "--no-progress", "--delete", str(work / "seed"), prefix], plain_env
            )
            print(f"uploaded {args.size_mib} MiB in {args.shards} shards to {prefix} in {seconds:.1f} s")
            shutil.rmtree(work / "seed")
        version = subprocess.run([args.aws, "--version"], capture_output=True, text=True, check=False).stdout
        load = os.getloadavg()[0]
        print(f"server: {args.endpoint_url}; {version.strip()}; {os.cpu_count()} CPUs, load {load:.1f}")

        plain_s, ours_s = [], []
        for i in range(args.repeat):
            for who in ("plain", "ours") if i % 2 == 0 else ("ours", "plain"):
                dest = work / who
                shutil.rmtree(dest, ignore_errors=True)
                if who == "plain":
                    plain_s.append(run([*aws, "s3", "sync", "--no-progress", prefix, str(dest)], plain_env))
                else:
                    ours_s.append(
                        run(
                            [
                                sys.executable,
                                str(TOOL),
                                "--source",
                                prefix,
                                "--dest",
                                str(dest),
                                "--endpoint-url",
                                args.endpoint_url,
                                "--region",
                                args.region,
                                "--aws",
                                args.aws,
                            ],
                            ours_env,
                        )
                    )
        noop_plain = run([*aws, "s3", "sync", "--no-progress", prefix, str(work / "plain")], plain_env)
        noop_ours = run(
            [
                sys.executable,
                str(TOOL),
                "--source",
                prefix,
                "--dest",
                str(work / "ours"),
                "--endpoint-url",
                args.endpoint_url,
                "--region",
                args.region,
                "--aws",
                args.aws,
            ],
            ours_env,
        )

        def fmt(xs: list[float]) -> str:
            return f"best {min(xs):6.2f} s, median {statistics.median(xs):6.2f} s"

        mb = (args.size_mib << 20) / 1e6
        print(f"full sync, {args.size_mib} MiB x{args.repeat}:")
        print(f"  aws s3 sync      {fmt(plain_s)}  ({mb / min(plain_s):.0f} MB/s)")
        print(f"  dflash-s3-sync   {fmt(ours_s)}  ({mb / min(ours_s):.0f} MB/s, every sha256 checked)")
        print(
            f"  ratio plain/ours {min(plain_s) / min(ours_s):.2f} best, "
            f"{statistics.median(plain_s) / statistics.median(ours_s):.2f} median  (goal >= 1.0)"
        )
        print("second run over a complete copy (nothing to download):")
        print(f"  aws s3 sync      {noop_plain:6.2f} s (lists the prefix)")
        print(
            f"  dflash-s3-sync   {noop_ours:6.2f} s (reads the manifest)  ratio {noop_plain / noop_ours:.2f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

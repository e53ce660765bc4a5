"""Benchmark: our shard sync (roles/shard_sync/files/dflash_s3_sync.py) against plain `aws s3 sync`.

    .venv/bin/python trainer/bench/bench_sync.py     # the lab's moto S3 on loopback, 400 MiB in 16 shards

Both run the same awscli against the same server and prefix, into fresh directories, alternately, --repeat
times; then each runs once more over its complete copy (the no-op case). Printed: seconds (best and median)
and the ratio plain/ours (>= 1.0: ours is as fast or faster), while ours also checks every shard's sha256
against the manifest and plain checks nothing. Ours runs with the awscli configuration the role writes from
the inventory (the lab's: 4 parallel requests, 64 MB parts, because moto is one Python process for which
ranged GETs cost more than they bring; a real S3 gets the role's defaults, 16 and 16 MB: pass them with
--max-concurrent-requests/--chunk-mb). Plain runs twice: with awscli's defaults (10, 8 MB), as `aws s3 sync`
runs when nobody tunes it, and with our configuration, which separates the tool's own cost from the tuning.
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
    parser.add_argument(
        "--max-concurrent-requests", type=int, default=4, help="ours (the lab inventory value)"
    )
    parser.add_argument("--chunk-mb", type=int, default=64, help="ours: multipart threshold and part size")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="dflash-bench-sync-", dir=args.work))
    tuned = work / "aws-config"
    tuned.write_text(
        f"[default]\nregion = {args.region}\ns3 =\n"
        f"  max_concurrent_requests = {args.max_concurrent_requests}\n"
        f"  multipart_threshold = {args.chunk_mb}MB\n  multipart_chunksize = {args.chunk_mb}MB\n"
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
    ours = [sys.executable, str(TOOL), "--source", prefix, "--endpoint-url", args.endpoint_url]
    ours += ["--region", args.region, "--aws", args.aws, "--dest"]
    try:
        head = subprocess.run(
            [*aws, "s3api", "head-bucket", "--bucket", args.bucket],
            env=plain_env,
            check=False,
            capture_output=True,
        )
        if head.returncode != 0:
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

        times: dict[str, list[float]] = {"plain": [], "tuned": [], "ours": []}
        order = list(times)
        for i in range(args.repeat):
            for who in order[i % 3 :] + order[: i % 3]:  # rotate who goes first
                dest = work / who
                shutil.rmtree(dest, ignore_errors=True)
                if who == "ours":
                    times[who].append(run([*ours, str(dest)], ours_env))
                else:
                    env = plain_env if who == "plain" else ours_env
                    times[who].append(run([*aws, "s3", "sync", "--no-progress", prefix, str(dest)], env))
        noop_plain = run([*aws, "s3", "sync", "--no-progress", prefix, str(work / "plain")], plain_env)
        noop_ours = run([*ours, str(work / "ours")], ours_env)

        def fmt(xs: list[float]) -> str:
            mb = (args.size_mib << 20) / 1e6
            return f"best {min(xs):6.2f} s, median {statistics.median(xs):6.2f} s ({mb / min(xs):4.0f} MB/s)"

        def ratio(a: list[float], b: list[float]) -> str:
            return f"{min(a) / min(b):.2f} best, {statistics.median(a) / statistics.median(b):.2f} median"

        cfg = f"{args.max_concurrent_requests} x {args.chunk_mb} MB"
        print(f"full sync, {args.size_mib} MiB in {args.shards} shards, {args.repeat} runs each:")
        print(f"  aws s3 sync      {fmt(times['plain'])}  awscli defaults (10 x 8 MB)")
        print(f"  aws s3 sync      {fmt(times['tuned'])}  our awscli config ({cfg})")
        print(f"  dflash-s3-sync   {fmt(times['ours'])}  our config, every sha256 checked")
        print(f"  ratio plain/ours {ratio(times['plain'], times['ours'])}  (goal >= 1.0)")
        print(f"  same config      {ratio(times['tuned'], times['ours'])}  (the tool's own cost)")
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

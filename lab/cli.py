"""`python -m lab up|down|status`: build, remove and report the local lab (see docs/lab.md)."""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from lab import containers, image, seed, services, shared_storage
from lab.errors import LabError
from lab.progress import heartbeat, say
from lab.settings import REPO, LabSettings, load_settings

# Files the lab made outside lab_dir in earlier versions; lab-down removes them too.
LEGACY_FILES = (Path("/tmp/dflash-smoke-lab.log"),)


def _ensure_one_container(settings: LabSettings, spec) -> bool:
    # CT 200's stand-in runs the CT image, as on a host; the host's stand-in a plain Debian minbase.
    if spec.role == "ct":
        make_rootfs = image.image_rootfs(settings)
        if containers.is_complete(spec.name) and not image.read_record(
            image.ct_record_path(settings, spec.name)
        ):
            say(f"lab: {spec.name} has no record of a CT image (an older lab): rebuilding")
            containers.remove(spec.name)
    else:
        make_rootfs = containers.minbase_rootfs(settings)
    part = containers.ensure_container(spec, settings, make_rootfs)
    say(f"lab: container {spec.name:<10} {'built/started' if part else 'ok'}")
    return part


def up(settings: LabSettings) -> bool:
    """Builds what is missing. The slow parts of a first build run side by side (the CT image build waits on
    the network and dpkg more than on the CPU): each container, and the seeding of the bucket's data."""
    changed = shared_storage.ensure(settings)  # before the containers that bind it start
    say(f"lab: {'shared storage':<20} {'mounted' if changed else 'ok'} ({settings.shared_storage_dir})")
    with concurrent.futures.ThreadPoolExecutor(len(settings.containers) + 1) as pool:
        seeding = pool.submit(seed.ensure_seed_files, settings)
        builds = [pool.submit(_ensure_one_container, settings, spec) for spec in settings.containers]
        errors = []
        for future in [*builds, seeding]:  # every part finishes (or fails) before the first error is raised
            try:
                changed |= future.result()
            except LabError as err:
                errors.append(err)
        if errors:
            raise errors[0]
    for daemon in services.daemons(settings):
        part = services.ensure_daemon(settings, daemon)
        say(f"lab: {daemon.name:<20} {'started' if part else 'ok'} ({daemon.url})")
        changed |= part
    with heartbeat(f"syncing the seed into s3://{settings.s3_bucket}"):
        part = seed.ensure_bucket(settings)
    say(f"lab: bucket {settings.s3_bucket:<13} {'seeded' if part else 'ok'}")
    changed |= part
    print(f"lab: {'changed' if changed else 'up, nothing changed'}")
    return changed


def lab_inventories() -> list[Path]:
    """Every lab inventory of the repository (inventory/lab, inventory/lab-multinode): `lab down` removes the
    containers of all of them, whichever one built them."""
    return sorted(p for p in (REPO / "inventory").glob("lab*") if p.is_dir())


def down(settings: LabSettings, others: Sequence[LabSettings] = ()) -> None:
    names = dict.fromkeys(spec.name for s in (settings, *others) for spec in s.containers)
    for name in names:
        removed = containers.destroy_container(name)
        print(f"lab: container {name:<10} {'removed' if removed else 'absent'}")
    for daemon in services.daemons(settings):
        stopped = services.stop_daemon(settings, daemon)
        print(f"lab: {daemon.name:<20} {'stopped' if stopped else 'not running'}")
    unmounted = shared_storage.stop(settings)
    print(f"lab: {'shared storage':<20} {'unmounted' if unmounted else 'not mounted'}")
    shutil.rmtree(settings.lab_dir, ignore_errors=True)
    print(f"lab: removed {settings.lab_dir}")
    for path in LEGACY_FILES:  # what older versions of `make smoke-train` left outside lab_dir
        if path.exists():
            path.unlink()
            print(f"lab: removed {path}")
    leftovers = [
        f"{d.host}:{d.port} ({owner})"
        for d in services.daemons(settings)
        if (owner := services.port_owner(d.host, d.port))
    ]
    if leftovers:
        raise LabError(f"lab ports still held after lab-down: {', '.join(leftovers)}")


# A lab file the inventory reads in a variable (`lookup('ansible.builtin.file', lab_dir + '/secrets/x')`).
_LAB_FILE_LOOKUP = re.compile(r"lookup\('ansible\.builtin\.file',\s*lab_dir\s*\+\s*'/?([^']+)'\)")


def inventory_files(settings: LabSettings) -> list[Path]:
    """The lab's files that the inventory's variables read (its secrets, the seed's digests), in the order
    written there: `make lab` writes them, and provisioning stops at the first one missing."""
    found: list[Path] = []
    # os.walk follows the symlinked group_vars that lab-multinode shares with lab (rglob does not).
    for root, _dirs, files in sorted(os.walk(settings.inventory, followlinks=True)):
        for name in sorted(f for f in files if f.endswith((".yml", ".yaml"))):
            text = (Path(root) / name).read_text()
            found += [settings.lab_dir / rel for rel in _LAB_FILE_LOOKUP.findall(text)]
    return list(dict.fromkeys(found))


def inventory_files_row(settings: LabSettings) -> tuple[str, bool, str]:
    """Status's row of `inventory_files`: up when each is there, else the missing ones by name."""
    wanted = inventory_files(settings)
    missing = [str(path.relative_to(settings.lab_dir)) for path in wanted if not path.is_file()]
    if missing:
        return (
            "inventory's files",
            False,
            f"missing under {settings.lab_dir}: {', '.join(missing)} (make lab writes them)",
        )
    return "inventory's files", True, f"{len(wanted)} files under {settings.lab_dir} (secrets, digests)"


def status(settings: LabSettings) -> bool:
    rows: list[tuple[str, bool, str]] = [inventory_files_row(settings)]
    for spec in settings.containers:
        systemd = containers.systemd_state(spec.name)
        pid = containers.init_pid(spec.name)
        rows.append(
            (
                f"container {spec.name}",
                systemd == "running",
                f"systemd {systemd}" + (f", init PID {pid}" if pid else ""),
            )
        )
        if spec.role == "ct":
            made_from = image.read_record(image.ct_record_path(settings, spec.name))
            rows.append(
                (
                    f"image of {spec.name}",
                    made_from is not None,
                    made_from.name if made_from else "no record of the image it was made from",
                )
            )
    daemons = services.daemons(settings)
    for daemon in daemons:
        pid = services.our_pid(settings, daemon)
        where = f"{daemon.url}, PID {pid}" if pid else f"{daemon.url}, no process of the lab"
        rows.append((daemon.name, services.answering(daemon), where))
    storage = settings.shared_storage_dir
    fstype = shared_storage.mounted_fstype(storage)
    served = shared_storage.answering(storage)
    rows.append(("shared storage", served, f"{storage} ({fstype or 'not mounted'})"))
    s3_up = any(d.name == "s3" and services.answering(d) for d in daemons)
    listing = seed.bucket_listing(settings) if s3_up else []
    shards = [key for key in listing if key.startswith(seed.SHARDS_PREFIX) and key.endswith(".arrow")]
    model = [key for key in listing if key.startswith(seed.MODEL_PREFIX)]
    rows.append(
        (
            f"bucket {settings.s3_bucket}",
            bool(shards and model),
            f"{len(shards)} shards, {len(model)} model files",
        )
    )
    for name, ok, detail in rows:
        print(f"{name:<22} {'up  ' if ok else 'DOWN'}  {detail}")
    return all(ok for _, ok, _ in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument(
        "--inventory", type=Path, default=None, help="default inventory/lab; down: every lab inventory"
    )
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.inventory or REPO / "inventory" / "lab")
        if args.command == "up":
            up(settings)
        elif args.command == "down":
            others = [] if args.inventory else [load_settings(i) for i in lab_inventories()]
            down(settings, others)
        else:
            return 0 if status(settings) else 1
    except LabError as err:
        print(f"lab {args.command}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"lab {args.command}: interrupted; `make lab` repairs what was left half-built", file=sys.stderr
        )
        return 130
    return 0

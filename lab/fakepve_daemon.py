"""fakepve as the lab runs it: `python -m lab.fakepve_daemon` takes fakepve's own arguments.

Where fakepve differs from a real Proxmox VE host in a way the roles would notice, this class answers as the
host does (each with the upstream source it imitates):

- Template uploads are streamed, as a real host streams them to its template storage. fakepve reads every
  request body into memory first and refuses one over 64 MiB; the L2 role uploads the real cpu image (about
  700 MiB) in the lab, and parsing that in memory takes longer than the 5 s read timeout that
  community.proxmox gives proxmoxer. Here the upload route counts the file's bytes as they arrive and
  keeps only its size.
- A CT's description comes back as PVE stores it: as comment lines of /etc/pve/lxc/ID.conf, read back with a
  newline after each line (pve-container src/PVE/LXC/Config.pm: parse_pct_config appends "\\n" to every `#`
  line; write_pct_config splits the description on newlines). So "text" is answered as "text\\n".
- State survives a restart, as a host's storage and /etc/pve do: containers and storage contents are
  written to state.json beside the guests file and read back at start (fakepve keeps them in memory
  only), so a restarted lab API still has the template and CT 200 and L2 changes nothing.
- host_shutdown(node) is what pve-guests.service does when the host shuts down or reboots (pve-manager
  PVE/API2/Nodes.pm stopall): each running guest gets a clean shutdown with its `startup: down=` timeout,
  180 s when unset, and is stopped hard after it (force-stop defaults to 1).
- API tasks take time (the daemon and the tests run with LAB_TIME_SCALE, not fakepve's instant 0). A create
  lasts as long as unpacking its template does (create_secs). A shutdown that outlives its timeout (PVE's
  default 60 s) without forceStop fails "container did not stop" while the CT goes on stopping and ends
  stopped; with forceStop, and in a reboot, the CT is killed at the timeout (_ct_powerdown).
- The task list shows finished tasks only unless `source` says active or all, as PVE's does (_task_list).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import fakepve.__main__ as fakepve_cli
from fakepve.model import PveError, TaskError
from fakepve.routing import die, split_list
from fakepve.server import USER, FakePve, ok, params

UPLOAD_MAX_BYTES = 16 * 1024**3  # the cuda image is several GB
# Real seconds per PVE second of every task: a 120 s create takes 6 s, a 60 s shutdown timeout 3 s, so the
# roles wait on tasks that are still running, as on a host, and the tests stay fast.
LAB_TIME_SCALE = 0.05
# A create unpacks the template (pve-container src/PVE/LXC/Create.pm restore_archive: tar --zstd under
# lxc-usernsexec for an unprivileged CT) onto a fresh ext4 on LVM-thin. A zstd CT template is about a third
# of its unpacked size, and tar writing many small files (CUDA and torch libraries) to a thin volume runs at
# 100-200 MB/s: a 6 GB cuda template (about 18 GB unpacked) takes about 2 minutes. 20 PVE s per GB of
# template, plus the volume's allocation and mkfs.
CREATE_S_PER_GB = 20
CREATE_BASE_S = 5
# pve-manager PVE/API2/Nodes.pm stopall: $d->{down} // $param->{timeout} // 180
STOPALL_DEFAULT_TIMEOUT_S = 180
SAVE_EVERY_S = 0.5


def _is_upload(request) -> bool:
    return request.method == "POST" and request.path.endswith("/upload")


def pve_description(value: str) -> str:
    """A description as PVE answers it after writing it to the CT's config: every line ends in a newline
    (Perl's split drops trailing empty fields, parse_pct_config adds one newline per comment line)."""
    lines = str(value).split("\n")
    while lines and lines[-1] == "":
        lines.pop()
    return "".join(line + "\n" for line in lines)


def create_secs(template_bytes: int) -> float:
    """PVE seconds a create from a template of this size takes (CREATE_S_PER_GB)."""
    return CREATE_BASE_S + CREATE_S_PER_GB * template_bytes / 1024**3


def startup_down(startup: str | None) -> int | None:
    """The down= of a `startup` value (pve-startup-order: order=N,up=N,down=N), or None."""
    for part in str(startup or "").split(","):
        key, _, value = part.partition("=")
        if key.strip() == "down" and value.strip().isdigit():
            return int(value)
    return None


class LabFakePve(FakePve):
    state_path: Path | None = None  # set by main(): state.json beside the guests file

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.client_max_size = UPLOAD_MAX_BYTES
        self._saved = ""
        self._background: set[asyncio.Future] = set()
        if self.state_path is not None and self.state_path.exists():
            self.restore_state(json.loads(self.state_path.read_text()))

    # ------------------------------------------------------------ persistence

    def state(self) -> dict:
        """What a host keeps on disk: its containers' configs and its storages' contents."""
        cts = [
            {
                "vmid": ct.vmid,
                "node": ct.node,
                "status": ct.status,
                "config": ct.config,
                "pending": ct.pending,
            }
            for ct in self.cts
        ]
        storages = {
            name: {"volumes": store.get("volumes", {}), "files": sorted(store.get("files", ()))}
            | ({"avail": store["avail"]} if "avail" in store else {})
            for name, store in self.storages.items()
        }
        return {"cts": cts, "storages": storages}

    def restore_state(self, state: dict) -> None:
        for name, saved in state.get("storages", {}).items():
            if name in self.storages:
                store = self.storages[name]
                store["volumes"] = saved.get("volumes", {})
                store["files"] = set(saved.get("files", []))
                if "avail" in saved:
                    store["avail"] = saved["avail"]
        for saved in state.get("cts", []):
            # defaults=False: the saved config is complete, as the host's file is.
            ct = self.add_ct(
                saved["vmid"],
                node=saved["node"],
                status=saved["status"],
                config=saved["config"],
                defaults=False,
            )
            ct.pending = dict(saved.get("pending") or {})

    def save_state(self) -> None:
        if self.state_path is None:
            return
        text = json.dumps(self.state(), sort_keys=True, default=list)
        if text == self._saved:
            return
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, self.state_path)  # a reader never sees half a state
        self._saved = text

    async def _save_loop(self) -> None:
        while True:
            await asyncio.sleep(SAVE_EVERY_S)
            self.save_state()

    async def start(self, certfile, keyfile):
        await super().start(certfile, keyfile)
        if self.state_path is not None:
            self._saver = asyncio.get_running_loop().create_task(self._save_loop())

    # ------------------------------------------------------------ answers as PVE gives them

    async def _lxc_config_get(self, user, v):
        data = await super()._lxc_config_get(user, v)
        if "description" in data:
            text = pve_description(data["description"])
            if text:
                data["description"] = text
            else:
                del data["description"]
        return data

    async def _lxc_create(self, user, v):
        """A create takes as long as unpacking its template does (create_secs of the volume's size)."""
        sid, _, volname = str(v.get("ostemplate", "")).partition(":")
        volume = self._find_volume(sid, volname) if sid in self.storages else None
        self.ct_secs["create"] = create_secs(int((volume or {}).get("size") or 0))
        return await super()._lxc_create(user, v)

    async def _ct_powerdown(self, ct, timeout, force):
        """pve-container src/PVE/LXC.pm vm_stop: `lxc-stop --timeout T`, with `--nokill` unless forceStop
        (vm_shutdown's forceStop; vm_reboot always kills). lxc-stop has asked the CT's init to halt, and it
        goes on halting after lxc-stop gave up: without forceStop the task fails "container did not stop" and
        the CT stops when its own shutdown ends (ct.shutdown_secs); with it the CT is killed at the timeout.
        ct.stop_kind says which: 'clean' or 'killed' (a trainer's checkpoint save cut short)."""
        if ct.shutdown_secs <= timeout:
            await self.pause(ct.shutdown_secs)
            ct.stop_kind = "clean"
        elif force:
            await self.pause(timeout)
            ct.stop_kind = "killed"
        else:
            await self.pause(timeout)
            pid = ct.pid

            async def halting() -> None:
                await self.pause(ct.shutdown_secs - timeout)
                if ct.pid == pid and ct.status == "running":
                    ct.status, ct.pid, ct.stop_kind = "stopped", None, "clean"

            if self.time_scale:
                task = asyncio.ensure_future(halting())
                self._background.add(task)  # the loop keeps only a weak reference
                task.add_done_callback(self._background.discard)
            else:
                await halting()
            raise TaskError("container did not stop")
        ct.status, ct.pid = "stopped", None

    async def _task_list(self, request):
        """pve-manager PVE/API2/Tasks.pm node_tasks: `source` archive (the default) lists finished tasks only,
        active the running ones (status RUNNING), all both; typefilter keeps one task type. (fakepve lists
        running tasks by default, which a client that forgets source=active would rely on.)"""
        node, user = request.match_info["node"], request[USER]
        p = self._verify(request, await params(request))
        source = p.get("source") or "archive"
        audit = self.allowed(user, "/nodes/" + node, "Sys.Audit")
        data = []
        for task in self.tasklog:
            running = task["status"] == "running"
            if (
                task["node"] != node
                or not (audit or self._task_owner(user, task))
                or (p.get("vmid") is not None and task["id"] != str(p["vmid"]))
                or (p.get("typefilter") and task["type"] != p["typefilter"])
                or (source == "archive" and running)
                or (source == "active" and not running)
            ):
                continue
            view = self._task_view(task, True)
            data.append(view | {"status": "RUNNING"} if running else view)
        data.sort(key=lambda t: -t["starttime"])
        start = p.get("start", 0)
        return ok(data[start : start + p.get("limit", 50)])

    def host_shutdown(self, node: str = "pve1") -> dict[int, str]:
        """pve-guests.service stopping every running CT of node: 'clean' when the CT's own shutdown took no
        longer than its startup down= timeout (180 s when unset), 'killed' when it was stopped hard after."""
        result: dict[int, str] = {}
        for ct in sorted(self.cts, key=lambda c: c.vmid, reverse=True):
            if ct.node != node or ct.status != "running":
                continue
            down = startup_down(ct.config.get("startup"))
            timeout = STOPALL_DEFAULT_TIMEOUT_S if down is None else down
            result[ct.vmid] = "clean" if ct.shutdown_secs <= timeout else "killed"
            ct.status, ct.pid = "stopped", None
        return result

    # ------------------------------------------------------------ streamed uploads

    async def _read_body(self, request):  # the middleware's read of every body: uploads are left to _upload
        return b"" if _is_upload(request) else await super()._read_body(request)

    async def _upload(self, request):
        """fakepve's upload route (storage.StorageTransfer._upload), reading the body as a stream."""
        name, store = self._file_storage(request, "upload")
        user = request[USER]
        self.require(user, "/storage/" + name, "Datastore.AllocateTemplate")
        if request.content_type != "multipart/form-data":
            raise PveError(400, "bad upload request")
        fields: dict[str, str] = {}
        size = 0
        reader = await request.multipart()
        async for part in reader:
            if part.filename:
                fields["filename"] = part.filename
                while chunk := await part.read_chunk(1 << 20):
                    size += len(chunk)
            elif part.name:
                fields[part.name] = await part.text()
        content = fields.get("content")
        if content not in ("iso", "vztmpl") or "filename" not in fields:
            raise PveError(400, "Parameter verification failed.", {"content": "value not allowed"})
        self._need_file_storage(store, "can't upload to storage type '{0}'")
        if content not in split_list(store.get("content")):
            raise die(f"storage '{name}' does not support '{content}' content")
        self.uploaded = {**fields, "size": size}

        async def body_():
            self.store_file(name, fields["filename"], size, content)

        return ok(await self.task(request.match_info["node"], "imgcopy", "", user, body_))


def main() -> None:
    guests = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    if guests is not None:
        LabFakePve.state_path = Path(guests).resolve().with_name("state.json")
    fakepve_cli.FakePve = LabFakePve  # serve() builds its server through this module-level name
    fakepve_cli.main()


if __name__ == "__main__":
    main()

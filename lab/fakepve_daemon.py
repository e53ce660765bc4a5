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
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import fakepve.__main__ as fakepve_cli
from fakepve.model import PveError
from fakepve.routing import die, split_list
from fakepve.server import USER, FakePve, ok

UPLOAD_MAX_BYTES = 16 * 1024**3  # the cuda image is several GB
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

"""fakepve as the lab runs it: `python -m lab.fakepve_daemon` takes fakepve's own arguments.

One difference from the plain `fakepve` command: template uploads are streamed, as a real Proxmox host
streams them to its template storage. fakepve reads every request body into memory first and refuses one
over 64 MiB; the L2 role uploads the real cpu image (about 700 MiB) in the lab, and parsing that in memory
takes longer than the 5 s read timeout that community.proxmox gives proxmoxer. Here the upload route counts
the file's bytes as they arrive and keeps only its size, with fakepve's own checks and answers.
"""

from __future__ import annotations

import fakepve.__main__ as fakepve_cli
from fakepve.model import PveError
from fakepve.routing import die, split_list
from fakepve.server import USER, FakePve, ok

UPLOAD_MAX_BYTES = 16 * 1024**3  # the cuda image is several GB


def _is_upload(request) -> bool:
    return request.method == "POST" and request.path.endswith("/upload")


class LabFakePve(FakePve):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.client_max_size = UPLOAD_MAX_BYTES

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
    fakepve_cli.FakePve = LabFakePve  # serve() builds its server through this module-level name
    fakepve_cli.main()


if __name__ == "__main__":
    main()

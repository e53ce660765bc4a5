"""fakepve as the lab runs it: `python -m lab.fakepve_daemon` takes fakepve's own arguments.

One difference from the plain `fakepve` command: it accepts template uploads the size of the CT image.
fakepve refuses request bodies over 64 MiB, while a real Proxmox host streams uploads of several GB to its
template storage, and the L2 role uploads the real cpu image (about 800 MiB) in the lab. The upload's bytes
are dropped once stored (fakepve keeps only the size), so the daemon does not hold the image in memory.
"""

from __future__ import annotations

import fakepve.__main__ as fakepve_cli
from fakepve.server import FakePve

UPLOAD_MAX_BYTES = 8 * 1024**3
UPLOAD_BODY_TIMEOUT_S = 600.0  # real seconds a client may take to send an upload


class LabFakePve(FakePve):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.client_max_size = UPLOAD_MAX_BYTES
        self.body_timeout = UPLOAD_BODY_TIMEOUT_S

    async def _upload(self, request):  # fakepve's route handler: same answer, without keeping the bytes
        try:
            return await super()._upload(request)
        finally:
            if isinstance(self.uploaded, dict):
                self.uploaded = {k: v for k, v in self.uploaded.items() if k != "data"}


def main() -> None:
    fakepve_cli.FakePve = LabFakePve  # serve() builds its server through this module-level name
    fakepve_cli.main()


if __name__ == "__main__":
    main()

"""The trainer as a systemd service: sd_notify, trackers, preflight, the service entry, the rank launcher.

Entry points (wired to `dflash-train preflight|smoke|serve|launch`, and `python -m dflash_trainer.service`):
`preflight_main(argv)`, `smoke_main(argv)`, `service_main(argv)`, `launch_main(argv)`;
each returns an exit code.
"""

from __future__ import annotations

from collections.abc import Sequence


def preflight_main(argv: Sequence[str] | None = None) -> int:
    from dflash_trainer.service.preflight import main

    return main(argv)


def smoke_main(argv: Sequence[str] | None = None) -> int:
    from dflash_trainer.service.smoke import main

    return main(argv)


def service_main(argv: Sequence[str] | None = None) -> int:
    from dflash_trainer.service.serve import main

    return main(argv)


def launch_main(argv: Sequence[str] | None = None) -> int:
    from dflash_trainer.service.supervisor import main

    return main(argv)


__all__ = ["launch_main", "preflight_main", "service_main", "smoke_main"]

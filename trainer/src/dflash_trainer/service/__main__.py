"""`python -m dflash_trainer.service {preflight,smoke,serve,launch} ...`: the `dflash-train` entries."""

from __future__ import annotations

import sys

from dflash_trainer.service import launch_main, preflight_main, service_main, smoke_main

COMMANDS = {"preflight": preflight_main, "smoke": smoke_main, "serve": service_main, "launch": launch_main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m dflash_trainer.service {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())

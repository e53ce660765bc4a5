"""The layer checks' lxc-attach backend starts a command again only when lxc-attach aborted in its own
re-exec (before entering the container), never after a command that ran and failed."""

from tests.verify.backends import rexec_failed

ABORT = "Device or resource busy - Failed to rexec as memfd\nmunmap_chunk(): invalid pointer\nAborted\n"


def test_the_rexec_abort_is_retried() -> None:
    assert rexec_failed(134, ABORT)


def test_a_command_that_ran_is_not() -> None:
    assert not rexec_failed(1, ABORT)
    assert not rexec_failed(134, "Aborted\n")
    assert not rexec_failed(0, "")

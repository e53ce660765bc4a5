"""Ansible callback `heartbeat`: a plain line every 10 s while one task runs longer than that.

Long tasks (the trainer lock's pip install in L3, a DKMS build in L1, the first S3 sync in L4) print nothing
until they end; minutes of a silent terminal read as a hang. This says which task is still running and for
how long, through Ansible's own display, and nothing for tasks that end within 10 s. Enabled in
ansible/ansible.cfg (callbacks_enabled); DFLASH_HEARTBEAT_S changes the period, 0 turns it off.
"""

from __future__ import annotations

import os
import threading
import time

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
    name: heartbeat
    type: aggregate
    short_description: a line every 10 s while a task runs longer
    description:
      - Prints "... still running: TASK (N s)" every DFLASH_HEARTBEAT_S seconds (default 10) during a task.
    requirements:
      - enable in callbacks_enabled
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "heartbeat"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        self.every = float(os.environ.get("DFLASH_HEARTBEAT_S", "10") or 0)
        self.lock = threading.Lock()
        self.task: str | None = None
        self.since = 0.0
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def _start(self, name: str) -> None:
        if self.every <= 0:
            return
        with self.lock:
            self.task, self.since = name, time.monotonic()
        if self.thread is None:
            self.thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
            self.thread.start()

    def _beat(self) -> None:
        while not self.done.wait(self.every):
            with self.lock:
                task, since = self.task, self.since
            elapsed = time.monotonic() - since
            if task is not None and elapsed >= self.every:
                self._display.display(f"... still running: {task} ({elapsed:.0f} s)")

    def v2_playbook_on_task_start(self, task, is_conditional) -> None:
        self._start(task.get_name().strip())

    def v2_playbook_on_handler_task_start(self, task) -> None:
        self._start(f"handler {task.get_name().strip()}")

    def v2_playbook_on_stats(self, stats) -> None:
        with self.lock:
            self.task = None
        self.done.set()

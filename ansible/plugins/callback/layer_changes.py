"""Ansible callback `layer_changes`: what the plays before a layer's verify play changed, for
verify_layer.yml.

`make provision` (ansible/site.yml) verifies each layer right after its play. On a rerun that changes
nothing, the six testinfra runs were a third of its time (L3's imports torch and FLA in the CT).
verify_layer.yml skips a layer's checks when `verify_skip_unchanged` is on, the plays since the previous
verify play ran tasks and changed nothing on any host, and the same checks passed the last time they ran
(a stamp under build/verified/). To know the middle part, this callback counts the task results of every
play that is not a verify play (one whose vars set `verify_layer_play`), and when a verify play starts it
publishes the count in the environment variable DFLASH_LAYER_CHANGES (JSON: {"results": N, "changed":
[hosts]}), then starts counting afresh. Ansible forks its workers from this process after the play
started, so the verify play's tasks read it with lookup('env').

A play never seen (molecule's verify step is a run of its own) publishes nothing: the checks run. A failed
result that was ignored counts as a change, so only a clean, unchanged run skips. Loaded without being
enabled (CALLBACK_NEEDS_ENABLED = False), so ANSIBLE_CALLBACKS_ENABLED=... for profiling does not switch
it off.
"""

from __future__ import annotations

import json
import os

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
    name: layer_changes
    type: aggregate
    short_description: publishes what the plays before a verify play changed
    description:
      - Sets DFLASH_LAYER_CHANGES when a play whose vars set verify_layer_play starts.
"""

ENV = "DFLASH_LAYER_CHANGES"


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "layer_changes"
    CALLBACK_NEEDS_ENABLED = False

    def __init__(self) -> None:
        super().__init__()
        self.counting = False
        self.results = 0
        self.changed: set[str] = set()
        # A verify play of this run publishes; nothing inherited from a parent process may stand in for it.
        os.environ.pop(ENV, None)

    def v2_playbook_on_play_start(self, play) -> None:
        is_verify = bool(play.get_vars().get("verify_layer_play", False))
        if is_verify:
            os.environ[ENV] = json.dumps({"results": self.results, "changed": sorted(self.changed)})
            self.results, self.changed = 0, set()
        else:
            os.environ.pop(ENV, None)
        self.counting = not is_verify

    def _count(self, result, changed: bool) -> None:
        if self.counting:
            self.results += 1
            if changed:
                self.changed.add(result._host.get_name())

    def v2_runner_on_ok(self, result) -> None:
        self._count(result, bool(result._result.get("changed", False)))

    def v2_runner_on_failed(self, result, ignore_errors: bool = False) -> None:
        self._count(result, True)

    def v2_runner_on_unreachable(self, result) -> None:
        self._count(result, True)

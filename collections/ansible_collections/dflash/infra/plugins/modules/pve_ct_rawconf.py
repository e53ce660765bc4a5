#!/usr/bin/python
# Copyright: the dflash project. GNU General Public License v3.0+
"""Ansible module pve_ct_rawconf: raw lxc.* lines in a Proxmox CT config (/etc/pve/lxc/ID.conf)."""

from __future__ import annotations

import os
import re
import tempfile

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: pve_ct_rawconf
short_description: Keep raw lxc.* lines of a Proxmox container config, each once, in the main section
description:
  - Proxmox keeps the raw C(lxc.*) lines of the main section when it rewrites a CT config (only those before
    the first C([snapshot]) or C([pve:pending]) header), and it turns comment lines into the description.
  - So this module writes no markers. It owns the lines matching O(owned) in the main section, removes those
    not in O(lines) and duplicates, appends the missing ones at the end of the main section, and writes the
    file through a temporary name and a rename, as Proxmox does.
options:
  path:
    description: the CT config file
    type: path
    required: true
  lines:
    description: "raw lines as Proxmox writes them (C(lxc.key: value))"
    type: list
    elements: str
    default: []
  owned:
    description: regular expressions of the lines this module owns
    type: list
    elements: str
    required: true
  create:
    description: create the file when absent (lab only; on Proxmox the API creates it)
    type: bool
    default: false
author: dflash project
"""


def plan(text: str, lines: list[str], owned: list[re.Pattern]) -> str:
    body = text.splitlines()
    end = next((i for i, line in enumerate(body) if line.startswith("[")), len(body))
    main, rest = body[:end], body[end:]
    kept, seen = [], set()
    for line in main:
        if any(rx.search(line) for rx in owned):
            if line not in lines or line in seen:
                continue  # not wanted any more, or a duplicate
            seen.add(line)
        kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    kept += [line for line in lines if line not in seen]
    if rest:
        kept += ["", *rest] if rest[0] != "" else rest
    return "\n".join(kept) + "\n" if kept else ""


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "lines": {"type": "list", "elements": "str", "default": []},
            "owned": {"type": "list", "elements": "str", "required": True},
            "create": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    path, lines = module.params["path"], module.params["lines"]
    try:
        owned = [re.compile(rx) for rx in module.params["owned"]]
    except re.error as exc:
        module.fail_json(msg=f"pve_ct_rawconf: owned pattern is not a regular expression: {exc}")
    bad = [line for line in lines if not re.match(r"^lxc\.[a-z0-9_.]+: \S", line)]
    if bad:
        module.fail_json(msg=f"{path}: not a raw lxc line (want 'lxc.key: value'): {bad[0]!r}")
    unowned = [line for line in lines if not any(rx.search(line) for rx in owned)]
    if unowned:
        module.fail_json(
            msg=f"{path}: line {unowned[0]!r} matches no owned pattern, so it would be duplicated"
        )
    if not os.path.exists(path):
        if not module.params["create"]:
            module.fail_json(
                msg=f"{path}: no such file on this host; is CT config on another node, or the vmid wrong?"
            )
        before = ""
    else:
        with open(path, encoding="utf-8") as f:
            before = f.read()
    after = plan(before, lines, owned)
    changed = after != before
    result = {
        "changed": changed,
        "diff": {"before": before, "after": after, "before_header": path, "after_header": path},
    }
    if changed and not module.check_mode:
        directory = os.path.dirname(path)
        if module.params["create"]:
            os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".rawconf-", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(after)
            os.chmod(tmp, 0o640)
            os.rename(tmp, path)
        except OSError as exc:
            if os.path.exists(tmp):
                os.unlink(tmp)
            module.fail_json(msg=f"{path}: cannot write: {exc}")
    module.exit_json(**result)


if __name__ == "__main__":
    main()

#!/usr/bin/python
# Copyright: the dflash project. GNU General Public License v3.0+
"""Ansible module pve_ct: the parts of CT management that community.proxmox has no parameter for."""

from __future__ import annotations

import re
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.pve_devices import plan_entries, repeated_paths

try:
    import requests
    from proxmoxer import AuthenticationError, ProxmoxAPI
    from proxmoxer.core import ResourceException

    HAS_PROXMOXER = True
except ImportError:  # pragma: no cover - reported by the module
    HAS_PROXMOXER = False


DOCUMENTATION = r"""
module: pve_ct
short_description: Probe the Proxmox API for a container, and keep its devN passthrough entries
description:
  - C(action=probe) logs in, checks that the node is online and returns the container's config (or none),
    with a one-line error naming the API, the user or token, and the cause when it cannot.
  - C(action=devices) makes the container's devN entries exactly the given device paths, each once,
    keeping the index of a path that is already there, and its bind mount points (mpN with a host path)
    exactly the given ones; both are root@pam only on Proxmox, so it needs a password login as root@pam.
options:
  action: {description: probe or devices, type: str, choices: [probe, devices], default: probe}
  api_host: {description: API address, type: str, required: true}
  api_port: {description: API port, type: int, default: 8006}
  api_user: {description: user (user@realm), type: str, required: true}
  api_password: {description: password of api_user, type: str}
  api_token_id: {description: token name (without the user), type: str}
  api_token_secret: {description: token secret, type: str}
  validate_certs: {description: verify the TLS certificate, type: bool, default: true}
  ca_file: {description: CA bundle to verify against, type: path}
  timeout: {description: seconds per request, type: int, default: 5}
  node: {description: Proxmox node, type: str, required: true}
  vmid: {description: container id, type: int, required: true}
  devices:
    description: device paths for devN entries, in order
    type: list
    elements: dict
  mount_points:
    description: bind mounts for mpN entries (host_path, path, optionally read_only); storage volumes are kept
    type: list
    elements: dict
  restart: {description: restart the running container when an entry changed, type: bool, default: false}
author: dflash project
"""


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def root_cause(exc: BaseException) -> str:
    """The innermost reason of a requests/urllib3 error, whole: "[Errno 111] Connection refused", not the
    wrapper's "HTTPSConnectionPool(...): Max retries exceeded with url: ... (Caused by ...)" cut to fit."""
    seen: list[BaseException] = []
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.append(e)
        todo += [
            x
            for x in (*e.args, e.__cause__, e.__context__, getattr(e, "reason", None))
            if isinstance(x, BaseException)
        ]
    text = " ".join(one_line(e) for e in seen)
    errno = re.search(r"\[Errno -?\d+\] [^'\")\]]+", text)
    if errno:
        return errno.group(0).strip()
    ssl_reason = re.search(r"\[SSL: [A-Z_]+\] [^'\")(]+", text)
    if ssl_reason:
        return ssl_reason.group(0).strip()
    return one_line(seen[-1])


class Api:
    def __init__(self, module: AnsibleModule):
        p = module.params
        self.module = module
        self.where = f"Proxmox API https://{p['api_host']}:{p['api_port']}"
        self.who = f"{p['api_user']}!{p['api_token_id']}" if p["api_token_id"] else p["api_user"]
        kwargs = {"port": p["api_port"], "user": p["api_user"], "timeout": p["timeout"], "service": "PVE"}
        kwargs["verify_ssl"] = (p["ca_file"] or True) if p["validate_certs"] else False
        if p["api_token_id"]:
            kwargs.update(token_name=p["api_token_id"], token_value=p["api_token_secret"])
        else:
            kwargs["password"] = p["api_password"]
        self.kwargs = kwargs
        self.api = self.call(lambda: ProxmoxAPI(p["api_host"], **kwargs), "login")

    def fail(self, what: str, exc: Exception) -> None:
        if isinstance(exc, AuthenticationError):
            cause = f"authentication failed for {self.who} (wrong password or user)"
        elif isinstance(exc, ResourceException) and exc.status_code == 401:
            cause = f"authentication failed for {self.who} (HTTP 401: bad token or expired ticket)"
        elif isinstance(exc, ResourceException) and exc.status_code == 403:
            detail = f"{one_line(exc.status_message)} {one_line(exc.content)}"
            cause = f"permission denied for {self.who} (HTTP 403: {detail})"
        elif isinstance(exc, ResourceException):
            detail = f"{one_line(exc.status_message)} {one_line(exc.content)} {exc.errors or ''}"
            cause = f"HTTP {exc.status_code}: {detail}"
        elif isinstance(exc, requests.exceptions.SSLError):
            cause = (
                f"TLS certificate not trusted ({root_cause(exc)}): set pve_api_ca_file to the cluster's CA"
                " (/etc/pve/pve-root-ca.pem on the host)"
            )
        elif isinstance(exc, requests.exceptions.Timeout):
            cause = f"no answer within {self.module.params['timeout']} s (API hung or host overloaded)"
        elif isinstance(exc, requests.exceptions.ConnectionError):
            reason = root_cause(exc)
            hint = "is pveproxy running?" if "refused" in reason.lower() else "is the address right?"
            cause = f"cannot connect: {reason} ({hint})"
        else:
            cause = one_line(exc)
        self.module.fail_json(msg=f"{self.where}: {what}: {cause.strip()}")

    def call(self, fn, what: str, retries: int = 2):
        """Calls fn; a dropped connection is retried, anything else is one clear error."""
        for attempt in range(retries + 1):
            try:
                return fn()
            except (requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError) as exc:
                refused = "refused" in str(exc).lower()
                if attempt == retries or refused or isinstance(exc, requests.exceptions.SSLError):
                    self.fail(what, exc)
                time.sleep(0.5 * (attempt + 1))
            except Exception as exc:  # every cause becomes one line
                self.fail(what, exc)
        return None


def probe(module: AnsibleModule, api: Api) -> dict:
    p = module.params
    nodes = api.call(lambda: api.api.nodes.get(), "list nodes")
    node = next((n for n in nodes if n.get("node") == p["node"]), None)
    if node is None:
        module.fail_json(
            msg=f"{api.where}: node {p['node']} is not in the cluster ({[n['node'] for n in nodes]})"
        )
    if node.get("status") != "online":
        module.fail_json(msg=f"{api.where}: node {p['node']} is {node.get('status', 'offline')}")
    cts = api.call(lambda: api.api.nodes(p["node"]).lxc.get(), f"list containers of {p['node']}")
    ct = next((c for c in cts if int(c["vmid"]) == p["vmid"]), None)
    result = {"changed": False, "exists": ct is not None, "status": None, "config": {}, "pending": {}}
    if ct is not None:
        res = api.api.nodes(p["node"]).lxc(p["vmid"])
        result["status"] = ct.get("status")
        result["config"] = api.call(lambda: res.config.get(current=1), f"read CT {p['vmid']} config")
        pending = api.call(lambda: res.pending.get(), f"read CT {p['vmid']} pending changes")
        result["pending"] = {i["key"]: i.get("pending") for i in pending if "pending" in i or i.get("delete")}
    result["version"] = api.call(lambda: api.api.version.get(), "read version").get("version")
    return result


def devices(module: AnsibleModule, api: Api) -> dict:
    p = module.params
    if p["api_token_id"] or p["api_user"] != "root@pam":
        module.fail_json(
            msg=f"{api.where}: devN passthrough entries and bind mount points are root@pam only on Proxmox; "
            f"{api.who} cannot set them. Give pve_api_password for root@pam, or set ct_device_mode: raw"
        )
    wanted, mounts = p["devices"] or [], p["mount_points"] or []
    problem = repeated_paths(p["vmid"], wanted, mounts)
    if problem:
        module.fail_json(msg=problem)
    res = api.api.nodes(p["node"]).lxc(p["vmid"])
    current = api.call(lambda: res.config.get(), f"read CT {p['vmid']} config")
    sets, deletes = plan_entries(current, wanted, mounts)
    result = {"changed": bool(sets or deletes), "set": sets, "deleted": deletes, "restarted": False}
    if module.check_mode or not result["changed"]:
        return result
    args = dict(sets)
    if deletes:
        args["delete"] = ",".join(deletes)
    api.call(lambda: res.config.put(**args), f"set devN and mpN entries of CT {p['vmid']}", retries=0)
    if p["restart"]:
        status = api.call(lambda: res.status.current.get(), f"read CT {p['vmid']} status")
        if status.get("status") == "running":
            upid = api.call(lambda: res.status.reboot.post(), f"restart CT {p['vmid']}", retries=0)
            wait_task(module, api, upid, f"restart CT {p['vmid']}")
            result["restarted"] = True
    return result


def wait_task(module: AnsibleModule, api: Api, upid: str, what: str, timeout: float = 120) -> None:
    node = module.params["node"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = api.call(lambda: api.api.nodes(node).tasks(upid).status.get(), f"{what}: task status")
        if status.get("status") == "stopped":
            if status.get("exitstatus") != "OK":
                module.fail_json(msg=f"{api.where}: {what}: task ended with {status.get('exitstatus')}")
            return
        time.sleep(0.5)
    module.fail_json(msg=f"{api.where}: {what}: task {upid} still running after {timeout} s")


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "action": {"type": "str", "choices": ["probe", "devices"], "default": "probe"},
            "api_host": {"type": "str", "required": True},
            "api_port": {"type": "int", "default": 8006},
            "api_user": {"type": "str", "required": True},
            "api_password": {"type": "str", "no_log": True},
            "api_token_id": {"type": "str"},
            "api_token_secret": {"type": "str", "no_log": True},
            "validate_certs": {"type": "bool", "default": True},
            "ca_file": {"type": "path"},
            "timeout": {"type": "int", "default": 5},
            "node": {"type": "str", "required": True},
            "vmid": {"type": "int", "required": True},
            "devices": {"type": "list", "elements": "dict", "default": []},
            "mount_points": {"type": "list", "elements": "dict", "default": []},
            "restart": {"type": "bool", "default": False},
        },
        required_together=[("api_token_id", "api_token_secret")],
        required_one_of=[("api_password", "api_token_id")],
        supports_check_mode=True,
    )
    if not HAS_PROXMOXER:
        module.fail_json(
            msg="pve_ct needs proxmoxer and requests on the controller (the project venv has them)"
        )
    api = Api(module)
    result = probe(module, api) if module.params["action"] == "probe" else devices(module, api)
    module.exit_json(**result)


if __name__ == "__main__":
    main()

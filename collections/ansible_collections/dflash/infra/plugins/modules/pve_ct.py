#!/usr/bin/python
# Copyright: the dflash project. GNU General Public License v3.0+
"""Ansible module pve_ct: the parts of CT management that community.proxmox has no parameter for."""

from __future__ import annotations

import re
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.dflash.infra.plugins.module_utils.pve_devices import plan_entries, repeated_paths

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
  - C(action=probe) finds a container locked by a create (lock C(create)), and waits for that create task
    (up to I(task_timeout)), or fails with one line naming the lock and the fix when no create task runs.
  - C(action=create) creates the container from I(spec) (community.proxmox.proxmox's option names) and waits
    on the create task (its UPID) up to I(task_timeout), unpacking a large template outlasts an API timeout.
  - C(action=restart) shuts a running container down cleanly, giving it I(shutdown_timeout) seconds (PVE's
    own default is 60), waits for that task, and starts it again; it never kills the container, and a failure
    is one line with the container's state and what to run.
  - C(action=devices) makes the container's devN entries exactly the given device paths, each once,
    keeping the index of a path that is already there, and its bind mount points (mpN with a host path)
    exactly the given ones; both are root@pam only on Proxmox, so it needs a password login as root@pam.
options:
  action:
    description: what to do
    type: str
    choices: [probe, create, restart, devices]
    default: probe
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
  spec:
    description: the container's create parameters, named as community.proxmox.proxmox names them (create)
    type: dict
  task_timeout: {description: seconds to wait for a create or start task, type: int, default: 600}
  shutdown_timeout: {description: seconds a clean shutdown may take (restart), type: int, default: 60}
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


def read_ct(api: Api, node: str, vmid: int) -> dict:
    """The container's list entry, config and pending changes (exists False when there is none)."""
    cts = api.call(lambda: api.api.nodes(node).lxc.get(), f"list containers of {node}")
    ct = next((c for c in cts if int(c["vmid"]) == vmid), None)
    result = {"exists": ct is not None, "status": None, "config": {}, "pending": {}}
    if ct is not None:
        res = api.api.nodes(node).lxc(vmid)
        result["status"] = ct.get("status")
        result["config"] = api.call(lambda: res.config.get(current=1), f"read CT {vmid} config")
        pending = api.call(lambda: res.pending.get(), f"read CT {vmid} pending changes")
        result["pending"] = {i["key"]: i.get("pending") for i in pending if "pending" in i or i.get("delete")}
    return result


def create_tasks(api: Api, node: str, vmid: int, source: str) -> list[dict]:
    """The node's create (or restore) tasks of vmid: source active lists running ones, archive ended ones
    (pve-manager PVE/API2/Tasks.pm node_tasks; its default, archive, never shows a running task)."""
    tasks = api.call(
        lambda: api.api.nodes(node).tasks.get(vmid=vmid, source=source), f"list the tasks of CT {vmid}"
    )
    return [t for t in tasks if t.get("type") in ("vzcreate", "vzrestore")]


def wait_for_create_lock(module: AnsibleModule, api: Api, found: dict) -> dict | None:
    """A container locked by a create: wait for the create task still running, or fail naming the lock."""
    p = module.params
    node, vmid = p["node"], p["vmid"]
    if found["config"].get("lock") != "create":
        return None
    running = create_tasks(api, node, vmid, "active")
    if not running:
        ended = create_tasks(api, node, vmid, "archive")
        last = f"its last create task ended with: {ended[0].get('status')}" if ended else "none is listed"
        module.fail_json(
            msg=f"{api.where}: CT {vmid} on {node} is locked (create) and no create task runs for it "
            f"({last}): a create that died half way left it. On {node}, remove it with `pct destroy {vmid}` "
            f"and rerun, or `pct unlock {vmid}` if its root disk is complete"
        )
    upid = running[0]["upid"]
    status = wait_task(api, node, upid, f"wait for the create of CT {vmid}", p["task_timeout"])
    if status.get("status") != "stopped":
        module.fail_json(
            msg=f"{api.where}: the create of CT {vmid} on {node} (task {upid}) still runs after "
            f"{p['task_timeout']} s (ct_create_timeout_s); the host goes on with it: rerun to wait again"
        )
    return {"upid": upid, "exitstatus": status.get("exitstatus"), "elapsed_s": status["elapsed_s"]}


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
    found = read_ct(api, p["node"], p["vmid"])
    waited = wait_for_create_lock(module, api, found)
    if waited is not None:  # a failed create removes the container (pve-container API2/LXC.pm create_vm)
        found = read_ct(api, p["node"], p["vmid"])
    result = {"changed": False, **found, "waited_for_create": waited}
    result["version"] = api.call(lambda: api.api.version.get(), "read version").get("version")
    return result


def create_params(spec: dict) -> dict:
    """community.proxmox.proxmox's options as the create call takes them (its create_lxc_instance): disk is
    rootfs, netif's keys are top-level, lists are comma-joined, booleans 0/1."""
    params: dict = {}
    for key, value in spec.items():
        if value is None or value == []:
            continue
        if key == "disk":
            params["rootfs"] = value
        elif key == "netif":
            params.update(value)
        elif isinstance(value, bool):
            params[key] = int(value)
        elif isinstance(value, list):
            params[key] = ",".join(str(v) for v in value)
        else:
            params[key] = value
    return params


def task_log_tail(api: Api, node: str, upid: str, lines: int = 3) -> str:
    entries = api.call(lambda: api.api.nodes(node).tasks(upid).log.get(limit=1000), "read the task log")
    return " | ".join(one_line(e.get("t", "")) for e in entries[-lines:])


def create(module: AnsibleModule, api: Api) -> dict:
    p = module.params
    node, vmid, timeout = p["node"], p["vmid"], p["task_timeout"]
    params = create_params(p["spec"] or {})
    template = params.get("ostemplate", "?")
    if module.check_mode:
        return {"changed": True, "msg": f"CT {vmid} on {node}: would be created from {template}"}
    lxc = api.api.nodes(node).lxc
    upid = api.call(lambda: lxc.post(vmid=vmid, **params), f"create CT {vmid}", retries=0)
    status = wait_task(api, node, upid, f"create CT {vmid}", timeout)
    if status.get("status") != "stopped":
        module.fail_json(
            msg=f"{api.where}: the create of CT {vmid} on {node} from {template} (task {upid}) still runs "
            f"after {timeout} s (ct_create_timeout_s); the host goes on with it: rerun to wait for it, or "
            "raise ct_create_timeout_s"
        )
    if status.get("exitstatus") != "OK":
        module.fail_json(
            msg=f"{api.where}: the create of CT {vmid} on {node} from {template} failed: "
            f"{one_line(status.get('exitstatus'))} (task log: {task_log_tail(api, node, upid)})"
        )
    return {
        "changed": True,
        "upid": upid,
        "elapsed_s": status["elapsed_s"],
        "msg": f"CT {vmid} on {node}: created from {template} in {status['elapsed_s']:.0f} s",
    }


def ct_state(api: Api, node: str, vmid: int) -> str:
    res = api.api.nodes(node).lxc(vmid)
    return api.call(lambda: res.status.current.get(), f"read CT {vmid} status").get("status", "unknown")


def restart_running(module: AnsibleModule, api: Api) -> str:
    """Clean shutdown with shutdown_timeout, then start; returns what happened. PVE's shutdown gives a CT 60 s
    unless told otherwise, and `pct reboot` kills it after 60 s (pve-container src/PVE/API2/LXC/Status.pm
    vm_shutdown: timeout default 60; src/PVE/LXC.pm vm_reboot: vm_stop(..., 1), lxc-stop's own 60 s): a
    trainer saving a checkpoint needs its whole stop timeout. No forceStop: a CT that outlives the timeout is
    left to finish its shutdown, never killed."""
    p = module.params
    node, vmid, timeout = p["node"], p["vmid"], p["shutdown_timeout"]
    res = api.api.nodes(node).lxc(vmid)
    upid = api.call(lambda: res.status.shutdown.post(timeout=timeout), f"shut down CT {vmid}", retries=0)
    # The worker gives lxc-stop the timeout plus 5 s (vm_stop); the margin covers a slow API.
    down = wait_task(api, node, upid, f"shut down CT {vmid}", timeout + 30)
    if down.get("status") != "stopped" or down.get("exitstatus") != "OK":
        state = ct_state(api, node, vmid)
        still = " (still stopping: the trainer may be saving its checkpoint)" if state == "running" else ""
        task = one_line(down.get("exitstatus") or "still running")
        module.fail_json(
            msg=f"{api.where}: restart of CT {vmid}: it did not shut down within {timeout} s "
            f"(ct_shutdown_timeout_s; task: {task}) and was not killed: CT {vmid} on {node} is {state}"
            f"{still}. When `pct status {vmid}` on {node} says stopped, run `pct start {vmid}`; raise "
            "trainer_service_timeout_stop_sec or ct_shutdown_margin_s if the trainer's save needs longer"
        )
    upid = api.call(lambda: res.status.start.post(), f"start CT {vmid}", retries=0)
    up = wait_task(api, node, upid, f"start CT {vmid}", p["task_timeout"])
    if up.get("status") != "stopped" or up.get("exitstatus") != "OK":
        state = ct_state(api, node, vmid)
        task = one_line(up.get("exitstatus") or "still running")
        module.fail_json(
            msg=f"{api.where}: restart of CT {vmid}: it shut down cleanly in {down['elapsed_s']:.0f} s but "
            f"did not start again (task: {task}): CT {vmid} on {node} is {state}. Run `pct start {vmid}` on "
            f"{node} and read its error"
        )
    return f"shut down cleanly in {down['elapsed_s']:.0f} s, started in {up['elapsed_s']:.0f} s"


def restart(module: AnsibleModule, api: Api) -> dict:
    p = module.params
    if not read_ct(api, p["node"], p["vmid"])["exists"]:  # check mode before the create
        return {"changed": False, "msg": f"CT {p['vmid']} does not exist: nothing to restart"}
    state = ct_state(api, p["node"], p["vmid"])
    if state != "running":
        return {"changed": False, "msg": f"CT {p['vmid']} is {state}: nothing to restart"}
    if module.check_mode:
        return {"changed": True, "msg": f"CT {p['vmid']} would be restarted"}
    return {"changed": True, "msg": f"CT {p['vmid']} on {p['node']}: {restart_running(module, api)}"}


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
            restart_running(module, api)
            result["restarted"] = True
    return result


def wait_task(api: Api, node: str, upid: str, what: str, timeout: float) -> dict:
    """Polls the task until it ends or timeout seconds passed; returns its last status (status stopped with
    its exitstatus, or running) and elapsed_s."""
    started = time.monotonic()
    delay = 0.2
    while True:
        status = api.call(lambda: api.api.nodes(node).tasks(upid).status.get(), f"{what}: task status")
        elapsed = time.monotonic() - started
        if status.get("status") == "stopped" or elapsed >= timeout:
            return {**status, "elapsed_s": round(elapsed, 1)}
        time.sleep(min(delay, max(timeout - elapsed, 0)))
        delay = min(delay * 1.5, 2.0)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "action": {
                "type": "str",
                "choices": ["probe", "create", "restart", "devices"],
                "default": "probe",
            },
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
            "spec": {"type": "dict"},
            "task_timeout": {"type": "int", "default": 600},
            "shutdown_timeout": {"type": "int", "default": 60},
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
    action = {"probe": probe, "create": create, "restart": restart, "devices": devices}[
        module.params["action"]
    ]
    module.exit_json(**action(module, api))


if __name__ == "__main__":
    main()

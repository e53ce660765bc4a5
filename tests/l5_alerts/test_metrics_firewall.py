"""roles/trainer_metrics' firewall rule (tasks/firewall.yml) against a private fakepve (tests/l5_service's
firewall_play, which also plays the job's rules): TCP in to node_exporter's port from the monitoring addresses
only, at the role's position; a second run changes nothing."""

from __future__ import annotations


def metrics_inventory() -> dict:
    metrics = {
        "trainer_metrics_sources": ["10.20.0.5", "10.20.1.0/24"],
        "trainer_metrics_port": 9100,
        "trainer_metrics_firewall_pos": 0,
    }
    return {"training_cts": {"vars": metrics, "hosts": {"ct-a": {"ct_vmid": 200}}}}


def test_the_metrics_port_opens_to_the_monitoring_addresses_only(fakepve, firewall_play) -> None:
    fakepve.add_ct(200, name="ct200-a")
    firewall_play.grant(200)

    first = firewall_play("trainer_metrics", "training_cts", metrics_inventory())
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.changed == 1, first.stdout
    rules = fakepve.firewall_config("ct", "pve1", "200")["rules"]
    got = [(r["type"], r["action"], r["proto"], r["source"], r["dport"]) for r in rules]
    assert got == [("in", "ACCEPT", "tcp", "10.20.0.5,10.20.1.0/24", "9100")], rules
    assert firewall_play.secret not in first.stdout

    second = firewall_play("trainer_metrics", "training_cts", metrics_inventory())
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.changed == 0, second.stdout

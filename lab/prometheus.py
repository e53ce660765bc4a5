"""The lab's Prometheus: Debian's `prometheus` package (bookworm), its binary run as a loopback daemon of the
lab (lab/services.py), scraping node_exporter in the lab CT (roles/trainer_metrics: 127.0.0.1:9100 in the lab,
the CT shares this machine's network) every 5 s. The package is fetched with `apt-get download` and unpacked
under lab_dir (its web UI's JavaScript dependencies are not needed for the API); `make lab-down` removes it.
"""

from __future__ import annotations

import glob
import subprocess
from pathlib import Path

from lab.errors import LabError
from lab.settings import LabSettings

HOST = "127.0.0.1"
PORT = 9191  # not 9090: a developer's own Prometheus may hold it
NODE_EXPORTER = "127.0.0.1:9100"  # inventory/lab/group_vars/training_cts/metrics.yml
SCRAPE_S = 5

CONFIG = f"""# lab/prometheus.py: the lab CT's node_exporter, as docs/alerting.md's scrape config.
global:
  scrape_interval: {SCRAPE_S}s
scrape_configs:
  - job_name: dflash-train
    static_configs:
      - targets: ["{NODE_EXPORTER}"]
        labels:
          ct: "200"
"""


def home(settings: LabSettings) -> Path:
    return settings.lab_dir / "prometheus"


def binary(settings: LabSettings) -> Path:
    return home(settings) / "root" / "usr" / "bin" / "prometheus"


def unpack(settings: LabSettings) -> Path:
    """The package's binary, downloaded and unpacked once."""
    exe = binary(settings)
    if exe.exists():
        return exe
    pkg = home(settings) / "pkg"
    pkg.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["apt-get", "download", "prometheus"],
        cwd=pkg,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    debs = glob.glob(str(pkg / "prometheus_*.deb"))
    if proc.returncode != 0 or not debs:
        raise LabError(f"prometheus: `apt-get download prometheus` failed: {proc.stderr.strip()[-300:]}")
    subprocess.run(["dpkg-deb", "-x", debs[0], str(home(settings) / "root")], check=True, timeout=300)
    if not exe.exists():
        raise LabError(f"prometheus: {debs[0]} has no usr/bin/prometheus")
    return exe


def prepare(settings: LabSettings) -> dict[str, str]:
    unpack(settings)
    (home(settings) / "data").mkdir(parents=True, exist_ok=True)
    (home(settings) / "prometheus.yml").write_text(CONFIG)
    return {}


def argv(settings: LabSettings) -> list[str]:
    return [
        str(binary(settings)),
        f"--config.file={home(settings) / 'prometheus.yml'}",
        f"--storage.tsdb.path={home(settings) / 'data'}",
        f"--web.listen-address={HOST}:{PORT}",
        "--storage.tsdb.retention.time=2d",
    ]

"""The lab's webhook receiver: a real HTTP endpoint on loopback for the training alerts (docs/alerting.md).

POST any path: the request (time, path, headers, body) is appended as one JSON line to the log file, and the
answer is 200. GET /received: every request so far, as JSON lines. GET /: "ok" (the lab's liveness check).
`python -m lab.webhook_receiver LOG --host 127.0.0.1 --port 7490`.
"""

from __future__ import annotations

import argparse
import http.server
import json
import threading
import time
from pathlib import Path

HOST = "127.0.0.1"
PORT = 7490  # inventory/lab/group_vars/training_cts/alerts.yml points the alerts here


def make_handler(log: Path, lock: threading.Lock) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length).decode("utf-8", "replace")
            record = {"time": time.time(), "path": self.path, "headers": dict(self.headers), "body": body}
            with lock, log.open("a") as f:
                f.write(json.dumps(record) + "\n")
            self._answer(200, b"ok\n")

        def do_GET(self) -> None:
            if self.path == "/received":
                with lock:
                    data = log.read_bytes() if log.exists() else b""
                self._answer(200, data, "application/x-ndjson")
            else:
                self._answer(200, b"ok\n")

        def _answer(self, code: int, data: bytes, kind: str = "text/plain") -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(
            self, fmt: str, *args: object
        ) -> None:  # one line per request on stderr (the lab log)
            print(f"{self.address_string()} {fmt % args}", flush=True)

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="JSON lines file of the requests received")
    parser.add_argument("--host", default=HOST)
    parser.add_argument("--port", type=int, default=PORT)
    args = parser.parse_args(argv)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    server = http.server.ThreadingHTTPServer((args.host, args.port), make_handler(args.log, threading.Lock()))
    print(f"webhook receiver on http://{args.host}:{args.port}/, requests to {args.log}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

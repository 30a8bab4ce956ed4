"""What the two preflight jobs run (grpo_lab.launch.preflight): the standard library only, so an HF
job runs this file from the bucket in a bare `python:3.12` image, with nothing installed.

    python3 preflight_probes.py replica --dir D --port P --token-env T   # job B
    python3 preflight_probes.py trainer --dir D --url U --token-env T    # job A

Job A plays the trainer: it writes into the mounted bucket as the adapter publish does (a whole
file, a folder, a directory rename), publishes a beacon, then reaches job B's exposed port with
the bearer token, without it and with a wrong one. Job B plays a replica: it serves a port that
the jobs proxy guards with the token (locally, where nothing is in front, it checks the token
itself), and watches its own mount for A's beacon, so the
time from A's write to B's sight is the lag every weight sync waits out. Each job writes what it
found as a JSON file in the bucket, written whole (a bucket mount takes no append).
"""

from __future__ import annotations

import argparse
import hmac
import http.server
import json
import os
import threading
import time
import urllib.error
import urllib.request

BEACON = "beacon/written.json"
"""Job A's beacon, relative to the run's preflight folder; published by a directory rename."""
RESULT = "{role}-probe.json"
"""Each job's findings in the preflight folder: `trainer-probe.json`, `replica-probe.json`."""


def write_whole(path: str, data: dict) -> None:
    """A new file written whole (`w` truncates): what a bucket mount takes."""
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def attempt(action) -> dict:
    """Run one mount operation: {"ok": True} or {"ok": False, "error": "OSError: ..."}."""
    try:
        action()
        return {"ok": True, "error": None}
    except OSError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


# ---------------------------------------------------------------------------------------------
# Job A: the trainer's side
# ---------------------------------------------------------------------------------------------

def check_mount(folder: str) -> dict:
    """The adapter publish's operations, in its order: stage a folder with a file written whole,
    publish it by a directory rename, read it back under its new name, overwrite a file whole."""
    staged, published = os.path.join(folder, ".staged.tmp"), os.path.join(folder, "published")
    found = {"whole_file_write": attempt(lambda: write_whole(os.path.join(folder, "probe.json"),
                                                              {"written": True}))}
    found["folder"] = attempt(lambda: (os.makedirs(staged, exist_ok=True),
                                       write_whole(os.path.join(staged, "adapter.json"), {})))
    found["rename"] = attempt(lambda: os.rename(staged, published))  # the publish itself
    if found["rename"]["ok"]:
        found["read_after_rename"] = attempt(lambda: read_json(os.path.join(published,
                                                                            "adapter.json")))
    found["overwrite"] = attempt(lambda: write_whole(os.path.join(folder, "probe.json"),
                                                     {"written": 2}))
    return found


def publish_beacon(folder: str, renames: bool) -> dict:
    """The beacon job B watches for, published as an adapter is: staged, then renamed into place
    (written in place where the mount cannot rename). Its `written_at` starts the lag's clock."""
    staged, final = os.path.join(folder, ".beacon.tmp"), os.path.dirname(os.path.join(folder,
                                                                                       BEACON))
    written_at = time.time()
    os.makedirs(staged if renames else final, exist_ok=True)
    write_whole(os.path.join(staged if renames else final, os.path.basename(BEACON)),
                {"written_at": written_at})
    if renames:
        os.rename(staged, final)
    return {"written_at": written_at, "published_by": "rename" if renames else "write"}


def http_status(url: str, token: str | None, timeout_s: float = 30.0) -> dict:
    """GET url with `Authorization: Bearer <token>` (none if token is None): the status and the
    body's JSON, or the connection error."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=timeout_s) as response:
            return {"status": response.status, "body": json.loads(response.read() or b"null")}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": None}
    except (OSError, ValueError) as exc:
        return {"status": None, "error": f"{type(exc).__name__}: {exc}"}


def reach_replica(url: str, token: str, timeout_s: float) -> dict:
    """Wait (bounded) until job B's port answers with the token, then ask without it, with a wrong
    one and with it: the first two must be refused, the last served."""
    deadline, probe = time.monotonic() + timeout_s, url.rstrip("/") + "/probe"
    health = http_status(url.rstrip("/") + "/health", token)
    while health.get("status") != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
        health = http_status(url.rstrip("/") + "/health", token)
    return {"url": url, "health": health, "no_token": http_status(probe, None),
            "wrong_token": http_status(probe, token + "-wrong"), "token": http_status(probe, token)}


def measure_hold(url: str, token: str, holds_s: list[float]) -> dict:
    """How long the path to job B holds an open request: ask B to answer only after each of
    `holds_s` seconds in turn (longest last) and stop at the first answer that does not come
    back. On HF Jobs the public jobs proxy sits on that path; a completion that takes longer
    than it holds is cut there."""
    tried = []
    for hold in holds_s:
        got = http_status(f"{url.rstrip('/')}/hold/{hold:g}", token, timeout_s=hold + 60)
        tried.append({"hold_s": hold, "status": got.get("status"), "error": got.get("error")})
        if got.get("status") != 200:
            break
    held = [t["hold_s"] for t in tried if t["status"] == 200]
    cut = [t for t in tried if t["status"] != 200]
    return {"tried": tried, "longest_held_s": max(held) if held else None,
            "cut_at_s": cut[0]["hold_s"] if cut else None}


def run_trainer(args) -> int:
    os.makedirs(args.dir, exist_ok=True)
    mount = check_mount(args.dir)
    token = os.environ[args.token_env]
    result = {"role": "trainer", "mount": mount,
              "beacon": publish_beacon(args.dir, renames=mount["rename"]["ok"]),
              "reach": reach_replica(args.url, token, args.reach_timeout_s)}
    if args.holds_s:  # after the reach: B answers by then
        result["hold"] = measure_hold(args.url, token,
                                      sorted(float(h) for h in args.holds_s.split(",")))
    write_whole(os.path.join(args.dir, RESULT.format(role="trainer")), result)
    print(json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# Job B: a replica's side
# ---------------------------------------------------------------------------------------------

def bearer_matches(header: str | None, token: str) -> bool:
    """`Authorization: Bearer <token>`, compared in constant time (as the servers do)."""
    return hmac.compare_digest((header or "").encode(), f"Bearer {token}".encode())


def make_handler(token: str, check_token: bool):
    class Handler(http.server.BaseHTTPRequestHandler):
        """/health is open (the launcher's health check). With `check_token` (locally, where
        nothing stands in front of the port) every other path wants the token; on HF Jobs the
        jobs proxy in front checks it, and each answer only says whether the header reached
        this container (`bearer_seen`): nothing here depends on the proxy forwarding it."""

        def do_GET(self):
            seen = bearer_matches(self.headers.get("Authorization"), token)
            if check_token and self.path != "/health" and not seen:
                return self._send(401, {"error": "missing or wrong bearer token"})
            if self.path.startswith("/hold/"):  # answer only after that many seconds
                held = min(float(self.path.rsplit("/", 1)[1]), 900.0)
                time.sleep(held)
                return self._send(200, {"ok": True, "held_s": held, "bearer_seen": seen})
            self._send(200, {"ok": True, "path": self.path, "bearer_seen": seen})

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *args):  # one line per request in the job's log
            print(f"[replica-probe] {self.command} {self.path} -> {fmt % args}", flush=True)

    return Handler


def watch_beacon(folder: str, timeout_s: float, poll_s: float) -> dict:
    """Poll this job's mount for job A's beacon; the lag is from A's write to its first sight
    here. Listing the folder first makes a caching mount look again (a bare open may be answered
    from a cached 'no such file')."""
    path, started = os.path.join(folder, BEACON), time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            os.listdir(os.path.dirname(path))
            written_at = read_json(path)["written_at"]
            seen_at = time.time()
            return {"seen": True, "lag_s": seen_at - written_at, "written_at": written_at,
                    "seen_at": seen_at, "watch_timeout_s": timeout_s}
        except (OSError, ValueError, KeyError):
            time.sleep(poll_s)
    return {"seen": False, "lag_s": None, "watch_timeout_s": timeout_s}


def run_replica(args) -> int:
    os.makedirs(args.dir, exist_ok=True)
    token = os.environ[args.token_env]
    server = http.server.ThreadingHTTPServer(("0.0.0.0", args.port),
                                             make_handler(token, args.check_token))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"[replica-probe] serving on port {args.port}; watching {args.dir}", flush=True)
    result = {"role": "replica", **watch_beacon(args.dir, args.watch_timeout_s, args.poll_s)}
    write_whole(os.path.join(args.dir, RESULT.format(role="replica")), result)
    print(json.dumps(result), flush=True)
    # Serve on until stopped, as a replica does; a bound so that a forgotten job stops billing
    time.sleep(max(0.0, args.serve_timeout_s - args.watch_timeout_s))
    server.shutdown()
    return 0


def mount_problem(folder: str, writable: bool) -> str | None:
    """Why this job cannot use the bucket at `folder` (None: it can): the mount's top folder
    missing (the job has no volume there; a folder made now would sit on the job's own disk),
    or, where the job must write, a mount that refuses writes (read-only)."""
    top = os.path.join(os.sep, os.path.abspath(folder).split(os.sep)[1])
    if not os.path.isdir(top):
        return (f"{top} does not exist: the bucket is not mounted in this job (check the job's "
                f"volume, -v hf://buckets/<owner>/<name>:{top})")
    if not writable:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
        check = os.path.join(folder, "write-check.tmp")
        write_whole(check, {"ok": True})
        os.remove(check)
    except OSError as exc:
        return (f"cannot write in the bucket mount at {folder} ({type(exc).__name__}: {exc}): "
                "is it mounted read-only? The trainer's mount must be read-write")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="preflight_probes.py")
    sub = parser.add_subparsers(dest="role", required=True)
    replica = sub.add_parser("replica", help="job B: serve a port, watch the mount")
    replica.add_argument("--port", type=int, required=True)
    replica.add_argument("--watch-timeout-s", type=float, default=300.0)
    replica.add_argument("--poll-s", type=float, default=0.1)
    replica.add_argument("--serve-timeout-s", type=float, default=900.0)
    replica.add_argument("--check-token", action="store_true",
                         help="refuse a request without the token (where no proxy in front "
                              "checks it: the local backend)")
    trainer = sub.add_parser("trainer", help="job A: write into the mount, reach job B")
    trainer.add_argument("--url", required=True)
    trainer.add_argument("--reach-timeout-s", type=float, default=600.0)
    trainer.add_argument("--holds-s", default="",
                         help="comma-separated seconds job B holds a response in turn (the "
                              "path's hold limit); empty = skip")
    for role in (replica, trainer):
        role.add_argument("--dir", required=True, help="the run's preflight folder in the mount")
        role.add_argument("--token-env", required=True, help="env var holding the bearer token")
    args = parser.parse_args(argv)
    problem = mount_problem(args.dir, writable=args.role == "trainer")
    if problem:  # said in the job's log, which the preflight's report quotes
        print(f"[{args.role}-probe] {problem}", flush=True)
        return 3
    return run_replica(args) if args.role == "replica" else run_trainer(args)


if __name__ == "__main__":
    raise SystemExit(main())

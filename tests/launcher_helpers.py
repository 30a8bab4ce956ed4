"""Helpers the launcher tests share: a stand-in server for the local launcher, and a stand-in for
`HfApi`'s job and upload calls (no network, no token) with the blog's plan."""

from __future__ import annotations

import sys
import textwrap
import time
from types import SimpleNamespace

from grpo_lab.launch.local import LocalLauncher
from grpo_lab.launch.recipe_plan import (
    recipe_plan,
)
from grpo_lab.launch.specs import JobSpec
from grpo_lab.util.processes import free_port, group_members, is_alive

PY = sys.executable
# A stand-in server: prints LINES log lines, optionally spawns a grandchild that ignores
# SIGTERM (its pid goes to PIDFILE), then serves /health on PORT (0 = never listens).
DUMMY = textwrap.dedent("""
    import http.server, subprocess, sys, time
    port, pidfile, lines = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    for i in range(lines):
        print(f"log line {i}", flush=True)
    if pidfile != "-":
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
        open(pidfile, "w").write(str(child.pid))
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    if port:
        http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    time.sleep(120)
""")


def server_job(name, port=None, pidfile="-", lines=0, health_timeout_s=20.0, **kw) -> JobSpec:
    port = free_port() if port is None else port
    return JobSpec(name=name, command=[PY, "-c", DUMMY, str(port), str(pidfile), str(lines)],
                   health_url=f"http://127.0.0.1:{port}/health",
                   health_timeout_s=health_timeout_s, **kw)


def wait_dead(pids, timeout_s=10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(is_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def assert_no_orphans(launcher: LocalLauncher, extra_pids=()):
    for name, proc in launcher.procs.items():
        assert proc.poll() is not None, f"{name} still running"
        assert group_members(proc.pid) == [], f"{name}'s process group still has members"
    assert wait_dead(extra_pids, 2.0), "a grandchild survived"


BUCKET = "hf://buckets/me/grpo-lora"
TOKEN = "hf_fake_token_for_tests"


def blog_plan(**fields):
    """The blog's GPU setup: Qwen2.5-Math-1.5B, rank 1, two H200 replicas."""
    return recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="blog", **fields)


class FakeJobs:
    def __init__(self, fail_at: int | None = None):
        self.calls, self.cancelled, self.fail_at = [], [], fail_at
        self.uploads = []  # (uploads, token) per upload call, in order with the job calls

    def upload(self, uploads, token=None):
        self.uploads.append((list(uploads), token, len(self.calls)))

    def run_job(self, **kwargs):
        self.calls.append(kwargs)
        if len(self.calls) == self.fail_at:
            raise RuntimeError("402 Payment Required")
        job_id = f"{len(self.calls):024x}"
        urls = [f"https://{job_id}--{p}.hf.jobs" for p in kwargs["expose"] or []]
        return SimpleNamespace(id=job_id, url=f"https://huggingface.co/jobs/me/{job_id}",
                               status=SimpleNamespace(expose_urls=urls or None))

    def cancel_job(self, **kwargs):
        self.cancelled.append(kwargs["job_id"])


def flag_values(command: list[str]) -> dict[str, str]:
    """`--flag value` pairs of an argv (store_true flags map to "")."""
    return {a: "" if i + 1 == len(command) or command[i + 1].startswith("--") else command[i + 1]
            for i, a in enumerate(command) if a.startswith("--")}

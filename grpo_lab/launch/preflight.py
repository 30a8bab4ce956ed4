"""Preflight: two cheap CPU jobs that check, before any GPU is paid for, what the recipe needs of
its platform (docs/recipe.md, "The parts"), as the blog's companion repository does.

    report = run_preflight(RecipeConfig(backend="hf-jobs", bucket="hf://buckets/me/lora"))
    print(report.describe())          # each check, with its fix when it failed
    report.ok, report.sync_lag_s      # the mount's lag feeds the planner's weight-sync time

The two jobs are a `RunPlan` (grpo_lab.launch.specs) like the recipe's, run by the same launchers:
`replica-probe` serves a bearer-checked port and watches its mount, `trainer-probe` writes into
the mount as the adapter publish does (a whole file, a folder, a directory rename), publishes a
beacon and reaches the replica's port with and without the token (grpo_lab.launch.preflight_probes
is what they run). Each writes its findings into the bucket as JSON; `report_from_results` turns
them into a `PreflightReport`. `grpo-lab launch --preflight` runs this first.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..util.processes import free_port
from .follow import ENDED_STAGES, cancel_jobs, jobs_api, stage_of
from .hf_jobs import HfJobsLauncher, split_bucket_path
from .local import LaunchError, LocalLauncher
from .preflight_probes import RESULT
from .recipe_config import RecipeConfig
from .specs import CPU_IMAGE, BucketMount, JobSpec, RunPlan, shell_join, url_of

REPLICA, TRAINER = "replica-probe", "trainer-probe"
PROBES_FILE = Path(__file__).with_name("preflight_probes.py")
"""Uploaded into the bucket for the HF jobs (a bare python image runs it: stdlib only)."""
FLAVOR = "cpu-basic"
"""Both preflight jobs on HF Jobs: the cheapest flavor; nothing here needs a GPU."""
LOCAL_TOKEN_ENV = "PREFLIGHT_TOKEN"
"""Locally the bearer token is made up per run; on HF Jobs it is HF_TOKEN, as the proxy sends."""
HOLDS_S = {"local": (0.5, 1.0), "hf-jobs": (30.0, 90.0, 180.0)}
"""How long job B holds a response in turn, job A waiting for each: the longest that comes back
through the path a completion takes (on HF Jobs the public jobs proxy) bounds a completion's
duration. A 3,000-token completion at ~30 tokens/s takes about 100 s."""
WATCH_TIMEOUT_S = {"local": 30.0, "hf-jobs": 300.0}
"""How long job B watches its mount for job A's write (hf-mount polls every 30 s or so)."""


@dataclass
class Preflight:
    """The preflight's plan and where its jobs leave their results."""

    plan: RunPlan
    folder: str
    """The run's preflight folder in the bucket: a local path, or `hf://buckets/...`."""
    token_env: str
    watch_timeout_s: float


def preflight_plan(config: RecipeConfig | None = None, *, nonce: str | None = None,
                   watch_timeout_s: float | None = None, holds_s: tuple[float, ...] | None = None,
                   **fields) -> Preflight:
    """The two jobs for `config`'s backend and bucket (its other settings are the recipe's).
    `holds_s`: the response holds job A asks for (default HOLDS_S; () skips the measure)."""
    cfg = replace(config or RecipeConfig(), **fields)
    holds = HOLDS_S.get(cfg.backend, ()) if holds_s is None else holds_s
    run = cfg.run_name or time.strftime("recipe-%Y%m%d-%H%M%S")
    sub = f"{run}/preflight-{nonce or uuid.uuid4().hex[:8]}"  # fresh: no stale beacon is seen
    watch = watch_timeout_s or WATCH_TIMEOUT_S.get(cfg.backend, 300.0)
    if cfg.backend == "local":
        from ..util.home import grpo_lab_home

        bucket = Path(cfg.bucket or grpo_lab_home() / "bucket").expanduser().absolute()
        if str(bucket).startswith("hf:"):
            raise ValueError("the local backend needs a local directory as its bucket")
        folder, port, token_env = f"{bucket}/{sub}", free_port(), LOCAL_TOKEN_ENV
        probes = [sys.executable, "-m", "grpo_lab.launch.preflight_probes"]
        commands = ([*probes, *_replica_args(folder, port, token_env, watch, serve_s=3600,
                                             check_token=True)],  # no jobs proxy in front
                    [*probes, *_trainer_args(folder, token_env, reach_s=60, holds=holds)])
        job = {"volumes": [BucketMount(str(bucket), str(bucket))], "secrets": [token_env]}
        plan = {"backend": "local"}
        health, where = f"http://127.0.0.1:{port}/health", folder
    elif cfg.backend == "hf-jobs":
        if not (cfg.bucket or "").startswith("hf://buckets/"):
            raise ValueError("HF Jobs need a Storage Bucket: bucket='hf://buckets/<owner>/<bucket>'")
        root, where = cfg.mount_path or "/lora", f"{cfg.bucket.rstrip('/')}/{sub}"
        folder, token_env = f"{root}/{sub}", "HF_TOKEN"  # the token the proxy sends upstream
        port = free_port() if cfg.free_ports else cfg.port
        script = f"{folder}/probes.py"
        # The uploaded file may show in the mount some seconds late: wait for it (10 min at most)
        wait = f"for _ in $(seq 120); do test -f {script} && break; sleep 5; done"

        def in_bash(args: list[str]) -> list[str]:
            run_it = shell_join(["python3", script, *args])
            return ["bash", "-c", f"set -e\n{wait}\nexec {run_it}\n"]

        commands = (in_bash(_replica_args(folder, port, token_env, watch, serve_s=1500)),
                    in_bash(_trainer_args(folder, token_env, reach_s=900, holds=holds)))
        job = {"volumes": [BucketMount(cfg.bucket, root)], "secrets": [token_env],
               "flavor": FLAVOR, "image": CPU_IMAGE, "timeout": "30m"}
        plan = {"backend": "hf-jobs", "uploads": [(str(PROBES_FILE), f"{where}/probes.py")]}
        health = None  # HF Jobs: job A waits (bounded) for job B's port itself
    else:
        raise ValueError(f"backend must be local or hf-jobs, got {cfg.backend!r}")
    env = {"PYTHONUNBUFFERED": "1"}
    jobs = [JobSpec(name=REPLICA, command=commands[0], env=env, ports=[port], health_url=health,
                    health_timeout_s=60.0, **job),
            JobSpec(name=TRAINER, command=commands[1], env=dict(env), depends_on=[REPLICA], **job)]
    return Preflight(RunPlan(jobs, name=f"{run}-preflight", **plan), where, token_env, watch)


def _replica_args(folder: str, port: int, token_env: str, watch_s: float, serve_s: float,
                  check_token: bool = False):
    return ["replica", "--dir", folder, "--port", str(port), "--token-env", token_env,
            "--watch-timeout-s", f"{watch_s:g}", "--serve-timeout-s", f"{serve_s:g}",
            *(["--check-token"] if check_token else [])]


def _trainer_args(folder: str, token_env: str, reach_s: float, holds: tuple[float, ...] = ()):
    return ["trainer", "--dir", folder, "--url", url_of(REPLICA), "--token-env", token_env,
            "--reach-timeout-s", f"{reach_s:g}",
            *(["--holds-s", ",".join(f"{h:g}" for h in holds)] if holds else [])]


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------

@dataclass
class Finding:
    """One check: what was found and, when it failed, what to do."""

    check: str
    ok: bool
    message: str
    fix: str = ""


@dataclass
class PreflightReport:
    findings: list[Finding] = field(default_factory=list)
    sync_lag_s: float | None = None
    """Seconds from a write in one job's mount to its sight in another's: the wait every weight
    sync adds before the replicas can load the new adapter (None: never seen)."""

    @property
    def ok(self) -> bool:
        return bool(self.findings) and all(f.ok for f in self.findings)

    def describe(self) -> str:
        failed = [f for f in self.findings if not f.ok]
        head = ("Preflight: every check passed" if self.ok else
                f"Preflight FAILED: {len(failed)} of {len(self.findings)} checks")
        lines = [head]
        for f in self.findings:
            lines.append(f"  {'ok  ' if f.ok else 'FAIL'} {f.check}: {f.message}")
            if not f.ok and f.fix:
                lines.append(f"       fix: {f.fix}")
        if self.sync_lag_s is not None:
            lines.append(f"  mount visibility lag: {self.sync_lag_s:.2f} s (report.sync_lag_s)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"ok": self.ok, **asdict(self)}


MOUNT_CHECKS = [  # (result key, check, what the recipe does with it, fix)
    ("rename", "directory rename",
     "the trainer publishes each adapter by renaming its staged folder (grpo_lab.bucket.adapters)"
     ", so no replica ever loads a half-written one",
     "mount the bucket read-write in the trainer job with a mount that renames directories; do "
     "not start the recipe on this mount"),
    ("whole_file_write", "whole-file write", "the trainer writes adapters, checkpoints and its "
     "summary into the bucket", "mount the bucket read-write in the trainer job (no `:ro`)"),
    ("folder", "new folder", "each adapter version is a folder of its own",
     "mount the bucket read-write in the trainer job (no `:ro`)"),
    ("read_after_rename", "read after rename", "replicas load the adapter under its new name",
     "use a mount whose renames keep the files (not a copy that is still on its way)"),
    ("overwrite", "whole-file overwrite", "summary.json and checkpoint states are rewritten whole",
     "use a mount that takes a file written again from its start"),
]


def _reach_finding(check: str, answer: dict, refused: bool) -> Finding:
    status = answer.get("status")
    got = f"HTTP {status}" if status is not None else answer.get("error", "no answer")
    if refused:  # must be refused: 401 or 403
        return Finding(check, status in (401, 403), f"the replica's port answered {got}",
                       "a port that serves without the right token lets anyone with its URL "
                       "use the replica: serve with an API key (--api-key / VLLM_API_KEY) or "
                       "keep the port behind the jobs proxy")
    served = status == 200 and (answer.get("body") or {}).get("ok") is True
    return Finding(check, served, f"the replica's port answered {got} through its exposed URL",
                   "expose the replica's port (`--expose PORT`) and send the token it wants "
                   "(on HF Jobs an HF_TOKEN with read access); check the job is running")


def _hold_finding(hold: dict) -> Finding:
    """The response hold: how long a request may stay open on the path to a replica."""
    held, cut = hold["longest_held_s"], hold["cut_at_s"]
    if held is None:
        return Finding("response hold", False, f"a response held {cut:g} s was cut on the way",
                       "completions must return faster than that: shorter completions "
                       "(--max-completion-length), or --network-group (no public proxy)")
    limit = (f"; one held {cut:g} s was cut: a completion must return within ~{held:g} s "
             "(shorter completions, or --network-group)" if cut is not None
             else " (the longest tried)")
    return Finding("response hold", True, f"a response held {held:g} s came back{limit}")


def _log_end(logs: dict[str, str] | None, name: str) -> str:
    """'; its log ends: ...' with the last lines of job `name`'s log, if there is one."""
    lines = [line for line in (logs or {}).get(name, "").splitlines() if line.strip()][-3:]
    return f"; its log ends: {' | '.join(lines)}" if lines else ""


def report_from_results(trainer: dict | None, replica: dict | None,
                        watch_timeout_s: float, logs: dict[str, str] | None = None
                        ) -> PreflightReport:
    """The findings from the two jobs' JSON results (None: the job left none; `logs`, the tails
    of the jobs' logs by name, then say why), rename first."""
    findings, lag = [], None
    if trainer is None:
        findings.append(Finding("trainer-probe", False, "job A left no result in the bucket"
                                + _log_end(logs, TRAINER),
                                "read its log (locally logs/trainer-probe.log; on HF Jobs "
                                "`hf jobs logs <id>`)"))
    else:
        for key, check, why, fix in MOUNT_CHECKS:
            found = trainer["mount"].get(key)
            if found is None:  # read_after_rename when the rename failed
                continue
            message = f"works; {why}" if found["ok"] else f"refused ({found['error']}); {why}"
            findings.append(Finding(check, found["ok"], message, fix))
        reach = trainer["reach"]
        if trainer.get("hold"):
            findings.append(_hold_finding(trainer["hold"]))
        findings.append(_reach_finding("reached with the token", reach["token"], refused=False))
        findings.append(_reach_finding("refused without a token", reach["no_token"], refused=True))
        findings.append(_reach_finding("refused with a wrong token", reach["wrong_token"],
                                       refused=True))
        seen = (reach["token"].get("body") or {}).get("bearer_seen")
        if seen is not None:  # a note: the recipe does not depend on it
            findings.append(Finding("token inside the job", True, (
                "the Authorization header reached the replica's container" if seen else
                "the Authorization header did not reach the replica's container (the path in "
                "front consumed it): replicas must not want a key of their own there (leave "
                "VLLM_API_KEY unset; the jobs proxy checks the HF token)")))
    if replica is None:
        findings.append(Finding("replica-probe", False, "job B left no result in the bucket"
                                + _log_end(logs, REPLICA),
                                "read its log (locally logs/replica-probe.log; on HF Jobs "
                                "`hf jobs logs <id>`)"))
    elif replica["seen"]:
        lag = max(0.0, replica["lag_s"])  # clocks of two machines may differ by a little
        findings.append(Finding("mount visibility", True, f"job B saw job A's write after "
                                f"{lag:.2f} s; every weight sync waits about this long"))
    else:
        findings.append(Finding("mount visibility", False, f"job B never saw job A's write in "
                                f"{watch_timeout_s:g} s", "check that both jobs mount the same "
                                "bucket at the same path; a longer lag needs longer adapter-load "
                                "retries in the proxy"))
    order = {"directory rename": 0}  # a mount without rename is reported first
    findings.sort(key=lambda f: order.get(f.check, 1))
    return PreflightReport(findings, lag)


# ---------------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------------

def run_preflight(config: RecipeConfig | None = None, *, run_dir: str | Path | None = None,
                  api=None, launcher_options: dict | None = None, read_bucket=None,
                  poll_s: float = 2.0, timeout_s: float = 1800.0, **fields) -> PreflightReport:
    """Run the two jobs on `config`'s backend and report. Local: `LocalLauncher` processes
    (logs in `run_dir`). hf-jobs: `HfJobsLauncher` through `api` (default: the Hub's;
    `launcher_options` go to the launcher, `read_bucket(uri) -> bytes | None` reads a result)."""
    pre = preflight_plan(config, **fields)
    try:
        if pre.plan.backend == "local":
            results = _run_local(pre, Path(run_dir or Path("runs") / pre.plan.name), timeout_s)
        else:
            results = _run_hf_jobs(pre, api or jobs_api(), launcher_options or {}, read_bucket,
                                   poll_s, timeout_s)
    except (LaunchError, TimeoutError) as exc:
        return PreflightReport([Finding("preflight jobs", False, str(exc),
                                        "read the jobs' logs; nothing of the recipe started")])
    return report_from_results(*results[:2], pre.watch_timeout_s, logs=results[2])


def _wait_for(read, names: list[str], until: float, still_running,
              poll_s: float = 0.2) -> list[dict | None]:
    """Each named result once present (None for those absent at `until` or once nothing runs)."""
    found: dict[str, dict | None] = dict.fromkeys(names)
    while True:
        for name in names:
            if found[name] is None:
                data = read(name)
                found[name] = json.loads(data) if data else None
        if all(found.values()) or time.monotonic() > until or not still_running():
            return [found[n] for n in names]
        time.sleep(poll_s)


def _run_local(pre: Preflight, run_dir: Path, timeout_s: float):
    environ = {**os.environ, pre.token_env: secrets.token_urlsafe(16)}

    def read(name: str) -> bytes | None:
        path = Path(pre.folder) / name
        return path.read_bytes() if path.is_file() else None

    with LocalLauncher(pre.plan, run_dir, grace_s=2.0, environ=environ) as run:
        code = run.wait(TRAINER, timeout_s)
        until = time.monotonic() + pre.watch_timeout_s + 10
        found = _wait_for(read, [RESULT.format(role=r) for r in ("trainer", "replica")], until,
                          lambda: code == 0 and run.running(REPLICA))
        return (*found, {name: run.logs(name) for name in (TRAINER, REPLICA)})


def _job_log(api, job_id: str, namespace: str | None) -> str:
    """An ended job's log as text ('' if the Hub cannot give it)."""
    try:
        return "\n".join(api.fetch_job_logs(job_id=job_id, namespace=namespace))
    except Exception:  # a report without the log's words is still a report
        return ""


def download_bucket_file(api, uri: str) -> bytes | None:
    """One file of a Storage Bucket (`hf://buckets/owner/name/path`), or None if absent."""
    bucket_id, path = split_bucket_path(uri)
    with tempfile.TemporaryDirectory(prefix="grpo-lab-preflight-") as tmp:
        api.download_bucket_files(bucket_id, [(path, f"{tmp}/result.json")])
        result = Path(tmp) / "result.json"
        return result.read_bytes() if result.is_file() else None


def _run_hf_jobs(pre: Preflight, api, launcher_options: dict, read_bucket, poll_s: float,
                 timeout_s: float):
    read_bucket = read_bucket or (lambda uri: download_bucket_file(api, uri))
    launcher = HfJobsLauncher(pre.plan, run_job=api.run_job, cancel_job=api.cancel_job,
                              **launcher_options)
    jobs = launcher.submit()
    ids = {name: info.id for name, info in jobs.items()}
    namespace = launcher.namespace
    stages = dict.fromkeys(ids, "RUNNING")

    def look() -> dict[str, str]:
        for name, job_id in ids.items():
            stages[name] = stage_of(api.inspect_job(job_id=job_id, namespace=namespace))
        return stages

    try:
        deadline = time.monotonic() + timeout_s
        while look()[TRAINER] not in ENDED_STAGES:  # job A ends once it has done everything
            if time.monotonic() > deadline:
                raise TimeoutError(f"{TRAINER} still running after {timeout_s:g} s")
            time.sleep(poll_s)
        until = time.monotonic() + pre.watch_timeout_s + 60  # B may still be watching
        found = _wait_for(lambda name: read_bucket(f"{pre.folder}/{name}"),
                          [RESULT.format(role=r) for r in ("trainer", "replica")], until,
                          lambda: look()[REPLICA] not in ENDED_STAGES, poll_s)
        missing = [n for n, r in zip((TRAINER, REPLICA), found) if r is None]
        return (*found, {name: _job_log(api, ids[name], namespace) for name in missing})
    finally:  # job B serves until stopped, as a replica does: it must not bill on
        cancel_jobs(api, {n: i for n, i in ids.items() if stages[n] not in ENDED_STAGES},
                    namespace)

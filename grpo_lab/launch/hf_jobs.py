"""The Hugging Face Jobs launcher: submit a `RunPlan` (grpo_lab.launch.specs) as Hugging Face Jobs.

    HfJobsLauncher(recipe_plan(backend="hf-jobs", bucket="hf://buckets/me/lora")).submit()
    print(hf_jobs_commands(plan))                          # the same, as `hf jobs run` lines

Jobs are submitted in the plan's order. A job's ports are exposed through the jobs proxy
(`exposed_url`: requests need an HF token), and a later job's `{url:<job>}` placeholders become
those URLs: the trainer job reaches the replicas there. HF jobs outlive this process, so a
failed submission cancels the jobs already submitted. Before the first job, the plan's uploads go
into the bucket: by default a wheel of this grpo_lab checkout, which the jobs install from
their mount (grpo_lab is not on PyPI). Running the plan here instead:
grpo_lab.launch.local.
"""

from __future__ import annotations

import inspect
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..util.processes import wait_healthy
from .local import LaunchError, fill_urls
from .specs import (
    CHECKOUT,
    PACKAGE_WHEEL,
    URL_PLACEHOLDER,
    BucketMount,
    JobSpec,
    RunPlan,
    group_url,
    package_wheel_name,
)

REPLICAS_READY_TIMEOUT_S = 1800.0
"""How long the launcher waits for a replica's /health before it submits the trainer (the
trainer's own wait for the proxy has the same bound): a vLLM replica downloads its model and
compiles first."""

RUN_LABEL = "grpo-lab-run"
"""Every job of a plan gets the label `grpo-lab-run=<run name>`: `list_jobs(labels=...)` finds a
run's jobs from any machine (grpo_lab.launch.follow)."""


def package_source() -> Path:
    """The folder holding this grpo_lab's pyproject.toml (a source or editable install)."""
    source = CHECKOUT
    if not (source / "pyproject.toml").is_file():
        raise LaunchError(f"grpo_lab at {source} has no source folder to build a wheel from: "
                          "pass --install with a command that installs it in the jobs")
    return source


def wheel_command(source: str | Path, out_dir: str | Path, *, isolated: bool = True) -> list[str]:
    """`pip wheel` of the package at `source` into out_dir (isolated: pip fetches the build
    backend, setuptools, from PyPI)."""
    return [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
            *([] if isolated else ["--no-build-isolation"]), "--wheel-dir", str(out_dir),
            str(source)]


def build_package_wheel(out_dir: str | Path, *, isolated: bool = True) -> Path:
    """Build the wheel the HF jobs install; returns its path. The build runs on a clean copy of
    the package's files, never in the checkout: setuptools' `build/` folder there would keep
    modules that have since been moved or deleted, and ship them."""
    source = package_source()
    with tempfile.TemporaryDirectory(prefix="grpo-lab-wheel-src-") as copy:
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            if (source / name).is_file():
                shutil.copy2(source / name, Path(copy) / name)
        shutil.copytree(source / "grpo_lab", Path(copy) / "grpo_lab",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        subprocess.run(wheel_command(copy, out_dir, isolated=isolated), check=True, timeout=600)
    wheel = Path(out_dir) / package_wheel_name()
    if not wheel.is_file():
        raise LaunchError(f"pip wheel did not produce {wheel}: found "
                          f"{sorted(p.name for p in Path(out_dir).glob('*.whl'))}")
    return wheel


def split_bucket_path(uri: str) -> tuple[str, str]:
    """`hf://buckets/me/lora/wheels/x.whl` -> (`me/lora`, `wheels/x.whl`)."""
    parts = uri.removeprefix("hf://buckets/").split("/", 2)
    if not uri.startswith("hf://buckets/") or len(parts) < 3 or not all(parts):
        raise ValueError(f"not a file in a Storage Bucket: {uri!r}")
    return f"{parts[0]}/{parts[1]}", parts[2]


def upload_to_buckets(uploads: list[tuple[str, str]], *, token: str | None = None, api=None,
                      build_wheel: Callable[[Path], Path] = build_package_wheel) -> None:
    """Put a plan's uploads into their buckets (`HfApi.batch_bucket_files`), building the
    grpo_lab wheel first where PACKAGE_WHEEL is named. Each bucket is created first if it does
    not exist yet (private), so a plan runs on a new bucket as submitted."""
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    with tempfile.TemporaryDirectory(prefix="grpo-lab-upload-") as tmp:
        by_bucket: dict[str, list[tuple[str, str]]] = {}
        for source, destination in uploads:
            path = build_wheel(Path(tmp)) if source == PACKAGE_WHEEL else Path(source)
            bucket_id, path_in_bucket = split_bucket_path(destination)
            by_bucket.setdefault(bucket_id, []).append((str(path), path_in_bucket))
        for bucket_id, add in by_bucket.items():
            api.create_bucket(bucket_id, private=True, exist_ok=True, token=token)
            api.batch_bucket_files(bucket_id, add=add, token=token)


def exposed_url(job_id: str, port: int) -> str:
    """Where the jobs proxy exposes a job's port (requests need an HF token with read access)."""
    return f"https://{job_id}--{port}.hf.jobs"


def shell_var(job_name: str) -> str:
    """`replica-0` -> `REPLICA_0_ID`: the shell variable holding the job's id in dry-run lines."""
    return re.sub(r"[^A-Z0-9]", "_", job_name.upper()) + "_ID"


def hf_volume(mount: BucketMount):
    """The `huggingface_hub.Volume` for a bucket mount (`hf://buckets/<owner>/<bucket>[/sub]`)."""
    from huggingface_hub import Volume

    if not mount.on_hub:
        raise ValueError(f"HF Jobs mount Storage Buckets (hf://buckets/...), not {mount.source!r}")
    owner, bucket, *sub = mount.source.removeprefix("hf://buckets/").split("/", 2)
    return Volume(type="bucket", source=f"{owner}/{bucket}", mount_path=mount.mount_path,
                  read_only=mount.read_only, path=sub[0] if sub and sub[0] else None)


class HfJobsLauncher:
    """Submit each job of a plan as a Hugging Face Job, in order, through `run_job`.

    `run_job` and `cancel_job` default to huggingface_hub's (they need a token and the network);
    pass fakes to test (and `upload`, which puts the plan's uploads into the bucket before the
    first job: `upload_to_buckets` by default; and `exposed_url`, where a job's port is reached
    from its id, for a stand-in that runs the jobs elsewhere: tests/hf_jobs_emulator.py).
    A job's `{url:<job>}` placeholders become the exposed URL of that job.
    Secret values are read from `environ` (default: os.environ, plus your saved HF token for
    HF_TOKEN) at submission; all must be present before the first job is submitted.
    With `inspect_job` (huggingface_hub's), a job that reaches others by URL (the trainer) is
    submitted only once each of them answers `/health` at its exposed URL (with the HF token,
    as exposed ports require): it does not bill while the replicas start, nor wait its own
    timeout for replicas that failed (a job that ends first, or REPLICAS_READY_TIMEOUT_S
    without an answer, cancels what was submitted).
    """

    def __init__(self, plan: RunPlan, *, run_job: Callable[..., Any] | None = None,
                 cancel_job: Callable[..., Any] | None = None, namespace: str | None = None,
                 environ: dict[str, str] | None = None,
                 upload: Callable[..., Any] = upload_to_buckets,
                 exposed_url: Callable[[str, int], str] | None = None,
                 inspect_job: Callable[..., Any] | None = None,
                 ready_timeout_s: float = REPLICAS_READY_TIMEOUT_S, poll_s: float = 10.0):
        self.plan, self.namespace = plan, namespace
        self._inspect_job, self.ready_timeout_s, self.poll_s = inspect_job, ready_timeout_s, poll_s
        self._upload = upload
        self._exposed_url = exposed_url
        self._run_job, self._cancel_job = run_job, cancel_job
        self._environ = environ
        self.jobs: dict[str, Any] = {}  # name -> JobInfo
        self.urls: dict[str, str] = {}  # name -> exposed URL of its first port
        self.network_group = plan.network_group if plan.network_group and \
            "network_group" in inspect.signature(run_job or _hub_run_job()).parameters else None
        if plan.network_group and not self.network_group:
            print(f"this huggingface_hub has no network groups: the jobs reach each other at "
                  f"their public URLs (pip install -U huggingface_hub for {plan.network_group})",
                  file=sys.stderr)

    def _secret_values(self) -> dict[str, str]:
        environ = dict(os.environ if self._environ is None else self._environ)
        if "HF_TOKEN" not in environ and self._environ is None:
            from huggingface_hub import get_token  # the token saved by `hf auth login`

            token = get_token()
            if token:
                environ["HF_TOKEN"] = token
        names = sorted({s for j in self.plan.jobs for s in j.secrets})
        missing = [n for n in names if not environ.get(n)]
        if missing:
            raise LaunchError(f"secrets not set: {', '.join(missing)} (export them, or "
                              "`hf auth login` for HF_TOKEN)")
        return {n: environ[n] for n in names}

    def run_job_kwargs(self, job: JobSpec, secrets: dict[str, str]) -> dict[str, Any]:
        """The exact keyword arguments `run_job` gets for `job`."""
        # inside a network group a job reaches the others by alias; otherwise at public URLs
        urls = {name: group_url(name, self.plan[name].ports[0]) for name in self.urls} \
            if self.network_group else self.urls
        kwargs = {
            "image": job.image,
            "command": [fill_urls(arg, urls) for arg in job.command],
            "env": dict(job.env),
            "secrets": {name: secrets[name] for name in job.secrets},
            "flavor": job.flavor,
            "timeout": job.timeout,
            "name": f"{self.plan.name}-{job.name}",
            "labels": {RUN_LABEL: self.plan.name},
            "volumes": [hf_volume(v) for v in job.volumes],
            "expose": list(job.ports) or None,
        }
        if self.network_group:
            kwargs.update(network_group=self.network_group, network_aliases=[job.name])
        if self.namespace:
            kwargs["namespace"] = self.namespace
        return kwargs

    def submit(self) -> dict[str, Any]:
        """Submit every job; on a failure cancel the ones already submitted, then raise."""
        if self.plan.backend != "hf-jobs":
            raise LaunchError(f"this plan was built for the {self.plan.backend} backend")
        if self._run_job is None:
            self._run_job = _hub_run_job()
        secrets = self._secret_values()
        if self.plan.uploads:  # before any job: the replicas may install from the bucket at once
            try:
                self._upload(self.plan.uploads, token=secrets.get("HF_TOKEN"))
            except Exception as exc:
                raise LaunchError(f"uploading {[d for _, d in self.plan.uploads]}: {exc}; "
                                  "no job was submitted") from exc
        try:
            for job in self.plan.jobs:
                if self._inspect_job is not None:
                    for name in sorted(job.placeholders()):
                        self._wait_ready(name, secrets.get("HF_TOKEN"))
                info = self._run_job(**self.run_job_kwargs(job, secrets))
                self.jobs[job.name] = info
                if job.ports:
                    self.urls[job.name] = (self._exposed_url(info.id, job.ports[0])
                                           if self._exposed_url else self._url(info, job.ports[0]))
        except BaseException as exc:
            self.cancel()
            if isinstance(exc, Exception) and not isinstance(exc, LaunchError):
                raise LaunchError(f"submitting {self.plan.name}: {exc}") from exc
            raise
        return self.jobs

    def _wait_ready(self, name: str, token: str | None) -> None:
        """Return once job `name` answers /health at its exposed URL; LaunchError if it ends
        first or stays silent for `ready_timeout_s`."""
        url, job_id = f"{self.urls[name]}/health", self.jobs[name].id
        kwargs = {"job_id": job_id, **({"namespace": self.namespace} if self.namespace else {})}

        def alive() -> bool:
            stage = self._inspect_job(**kwargs).status.stage
            return getattr(stage, "value", stage) not in ("COMPLETED", "CANCELED", "ERROR",
                                                          "DELETED")
        said = [0]

        def report(waited: float, last: str) -> None:
            if waited >= 60 * (said[0] + 1):  # once a minute
                said[0] = int(waited // 60)
                print(f"waiting for {name} to answer {url} ({said[0]} min, {last}); the jobs "
                      "after it are not submitted yet", flush=True)
        try:
            wait_healthy(url, self.ready_timeout_s, alive=alive, poll_s=self.poll_s,
                         headers={"Authorization": f"Bearer {token}"} if token else None,
                         on_poll=report)
        except ChildProcessError as exc:
            raise LaunchError(f"{name} ended before it served: {exc}; see its logs "
                              f"(`hf jobs logs {job_id}`)") from None
        except TimeoutError as exc:
            raise LaunchError(f"{name} did not answer within {self.ready_timeout_s:g} s: "
                              f"{exc}") from None
        print(f"{name} answers {url}", flush=True)

    @staticmethod
    def _url(info: Any, port: int) -> str:
        status = getattr(info, "status", None)
        for url in getattr(status, "expose_urls", None) or []:
            if url.rstrip("/").endswith(f"--{port}.hf.jobs"):
                return url.rstrip("/")
        return exposed_url(info.id, port)

    def cancel(self) -> None:
        """Cancel every job this launcher submitted (HF jobs outlive this process otherwise)."""
        if not self.jobs:
            return
        if self._cancel_job is None:
            from huggingface_hub import cancel_job

            self._cancel_job = cancel_job
        for name, info in reversed(list(self.jobs.items())):
            kwargs = {"job_id": info.id}
            if self.namespace:
                kwargs["namespace"] = self.namespace
            try:
                self._cancel_job(**kwargs)
            except Exception as exc:  # keep cancelling the others
                print(f"could not cancel {name} ({info.id}): {exc}", file=sys.stderr)


def _hub_run_job():
    from huggingface_hub import run_job

    return run_job


def _double_quoted(text: str, urls: dict[str, str]) -> str:
    """`text` as one double-quoted shell word; placeholders become `$VAR` references."""
    out, pos = [], 0
    for m in URL_PLACEHOLDER.finditer(text):
        out.append(re.sub(r'(["$`\\])', r"\\\1", text[pos:m.start()]))
        out.append(urls[m.group(1)])
        pos = m.end()
    out.append(re.sub(r'(["$`\\])', r"\\\1", text[pos:]))
    return '"' + "".join(out) + '"'


def hf_jobs_commands(plan: RunPlan, namespace: str | None = None) -> str:
    """The plan as `hf jobs run` lines to paste into a shell (bash): replicas first, each id
    kept in a shell variable, then the trainer job, which reaches them at their exposed URLs."""
    needed = {dep for job in plan.jobs for dep in job.placeholders()}
    urls = {name: group_url(name, plan[name].ports[0]).replace("$", "\\$")  # the job's shell
            if plan.network_group else exposed_url("${" + shell_var(name) + "}",
                                                    plan[name].ports[0]) for name in needed}
    lines = [f"# {plan.name}: {len(plan.jobs)} Hugging Face Jobs; needs `hf auth login` "
             "(or HF_TOKEN exported) and the bucket created"]
    for source, destination in plan.uploads:
        if source == PACKAGE_WHEEL:
            lines.append("# the grpo_lab wheel the jobs install, through the bucket")
            lines.append(shlex.join(["python3", *wheel_command(package_source(), "dist")[1:]]))
            source = f"dist/{package_wheel_name()}"
        lines.append(shlex.join(["hf", "buckets", "cp", source, destination]))
    for job in plan.jobs:
        args = ["hf", "jobs", "run", "--detach"] + (["--quiet"] if job.name in needed else [])
        args += ["--name", f"{plan.name}-{job.name}", "--flavor", job.flavor]
        args += ["--timeout", job.timeout] if job.timeout else []
        args += ["--namespace", namespace] if namespace else []
        args += ["--label", f"{RUN_LABEL}={plan.name}"]
        if plan.network_group:
            args += ["--network-group", plan.network_group, "--network-alias", job.name]
        for name in job.secrets:
            args += ["--secrets", name]
        for port in job.ports:
            args += ["--expose", str(port)]
        for volume in job.volumes:
            args += ["-v", volume.cli_spec()]
        for key, value in job.env.items():
            args += ["-e", f"{key}={value}"]
        words = [shlex.join(args), "--", shlex.quote(job.image)]
        words += [_double_quoted(a, urls) if URL_PLACEHOLDER.search(a) else shlex.quote(a)
                  for a in job.command]
        line = " ".join(words)
        lines.append(f"# {job.name}")
        lines.append(f"{shell_var(job.name)}=$({line})" if job.name in needed else line)
    return "\n".join(lines)

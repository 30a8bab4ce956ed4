"""Job specs: the recipe's processes written down as data, before anything starts.

    replica-0 ──┐                                  one bucket, mounted at the same absolute
    replica-1 ──┼──> proxy ──> trainer             path in every job (`/lora` on HF Jobs):
    ...        ─┘   127.0.0.1, beside the trainer  the trainer writes adapters, replicas read

A `RunPlan` is an ordered list of `JobSpec`s; `recipe_plan()` builds docs/recipe.md's plan. The
same plan goes to either launcher: `LocalLauncher` (grpo_lab.launchers) runs each job as an OS
process on this machine, `HfJobsLauncher` (grpo_lab.hf_jobs) submits each as a Hugging Face Job.

Where the proxy runs: on HF Jobs it runs **inside the trainer job** (as in the recipe), because it
must sit on 127.0.0.1 next to the trainer and hold the token that exposed job ports need. Locally
it is **a job of its own** (own log, own process group, health-checked before the trainer starts),
which changes nothing for the trainer: it talks to `http://127.0.0.1:<port>` either way.

Secrets are names only (`HF_TOKEN`); launchers read their values from the environment when they
start a job, so no value is ever stored in a plan, printed, or written to disk.
"""

from __future__ import annotations

import re
import shlex
import socket
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

VLLM_IMAGE = "vllm/vllm-openai:v0.27.1"
"""Replica image on GPU flavors (pinned: the version the blog's LoRA path was validated on)."""
CPU_IMAGE = "python:3.12"
HF_BLOG_MODEL = "Qwen/Qwen2.5-Math-1.5B"
NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]*")
URL_PLACEHOLDER = re.compile(r"\{url:([a-z0-9][a-z0-9-]*)\}")


def url_of(job_name: str) -> str:
    """A placeholder for a job's URL, filled in by the launcher once the job exists.

    On HF Jobs a replica's URL (`https://<job_id>--8000.hf.jobs`) is known only after it is
    submitted, so the trainer job's command names it as `{url:replica-0}`. Locally it becomes
    `http://127.0.0.1:<first port>`.
    """
    return f"{{url:{job_name}}}"


def shell_join(args: list[str]) -> str:
    """shlex.join, but a bare `{url:<job>}` placeholder stays unquoted (a URL needs no quotes)."""
    return " ".join(a if URL_PLACEHOLDER.fullmatch(a) else shlex.quote(a) for a in args)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_gpu_flavor(flavor: str) -> bool:
    """HF Jobs flavors are `cpu-*` or a GPU name (`t4-small`, `a10g-large`, `h200`, ...)."""
    return not (flavor == "local" or flavor.startswith("cpu"))


@dataclass
class BucketMount:
    """The bucket as one job sees it."""

    source: str
    """A local directory (local backend) or `hf://buckets/<owner>/<bucket>` (HF Jobs)."""
    mount_path: str
    """Absolute path where the job sees the bucket; the same in every job of a plan, so a path
    the trainer sends in a request is valid on every replica."""
    read_only: bool = False
    """Replicas only read adapters. HF Jobs enforces it; the local backend cannot (no mounts),
    so there the servers are confined with `--allowed-lora-root` instead."""

    def __post_init__(self):
        if not self.mount_path.startswith("/") or self.mount_path == "/":
            raise ValueError(f"mount_path must be an absolute path other than /, got {self.mount_path!r}")

    @property
    def on_hub(self) -> bool:
        return self.source.startswith("hf://buckets/")

    def cli_spec(self) -> str:
        """`hf jobs run -v` syntax: `hf://buckets/<owner>/<bucket>:/lora[:ro]`."""
        return f"{self.source}:{self.mount_path}" + (":ro" if self.read_only else "")


@dataclass
class JobSpec:
    """One job: a process locally, a Hugging Face Job remotely."""

    name: str
    """Short lowercase name, unique in the plan (`replica-0`, `proxy`, `trainer`)."""
    command: list[str]
    """argv of the job; `{url:<job>}` placeholders are filled in by the launcher."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set for the job (values are not secret: they are printed)."""
    secrets: list[str] = field(default_factory=list)
    """Names of environment variables whose values come from the user's environment (HF
    secrets on HF Jobs). Only names live here; values are never printed."""
    volumes: list[BucketMount] = field(default_factory=list)
    """The bucket, with this job's read-only flag."""
    ports: list[int] = field(default_factory=list)
    """Ports the job listens on: exposed through the jobs proxy on HF Jobs (token required)."""
    flavor: str = "local"
    """Hardware: `local` (this machine), or an HF Jobs flavor (`cpu-basic`, `h200`, ...)."""
    image: str = CPU_IMAGE
    """Docker image on HF Jobs (unused locally)."""
    timeout: str | None = None
    """Longest run on HF Jobs (`4h`, `90m`); locally the run ends when its `with` block does."""
    health_url: str | None = None
    """GET this until it answers 200 before starting the jobs that depend on this one
    (None = started is enough). Used by the local launcher."""
    health_timeout_s: float = 300.0
    """How long the launcher waits for `health_url` before it gives up."""
    depends_on: list[str] = field(default_factory=list)
    """Jobs that must be healthy before this one starts (earlier in the plan)."""

    def __post_init__(self):
        if not NAME_RE.fullmatch(self.name):
            raise ValueError(f"job name must be lowercase letters, digits and dashes, got {self.name!r}")
        if not self.command:
            raise ValueError(f"job {self.name!r} has an empty command")
        for name in self.secrets:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"secret names are environment variable names, got {name!r}")
            if name in self.env:
                raise ValueError(f"{name} is both a secret and a plain env var in job {self.name!r}")

    def placeholders(self) -> set[str]:
        """Jobs whose URL this job's command names."""
        return {m for arg in self.command for m in URL_PLACEHOLDER.findall(arg)}

    def describe(self) -> str:
        """Human-readable summary; secrets by name only."""
        where = "this machine" if self.flavor == "local" else f"flavor={self.flavor} image={self.image}"
        lines = [f"[{self.name}] {where}" + (f" timeout={self.timeout}" if self.timeout else "")]
        if self.depends_on:
            lines.append(f"  after:   {', '.join(self.depends_on)}")
        for v in self.volumes:
            lines.append(f"  bucket:  {v.source} at {v.mount_path} ({'read-only' if v.read_only else 'read-write'})")
        if self.ports:
            lines.append(f"  ports:   {', '.join(map(str, self.ports))}")
        if self.health_url:
            lines.append(f"  health:  {self.health_url} (wait up to {self.health_timeout_s:g} s)")
        if self.env:
            lines.append(f"  env:     {' '.join(f'{k}={v}' for k, v in self.env.items())}")
        if self.secrets:
            lines.append(f"  secrets: {', '.join(self.secrets)} (values from your environment)")
        lines.append(f"  command: {shlex.join(self.command)}")
        return "\n".join(lines)


@dataclass
class RunPlan:
    """Jobs in start order: every job's `depends_on` names jobs earlier in the list."""

    jobs: list[JobSpec]
    name: str = "grpo-lab"
    """Run name: prefixes HF job names, names the run's folder inside the bucket."""
    backend: str = "local"
    uploads: list[tuple[str, str]] = field(default_factory=list)
    """Files put into the bucket before any job starts: (local file, or PACKAGE_WHEEL for a
    wheel of this grpo_lab built at submission; destination `hf://buckets/...` path)."""

    def __post_init__(self):
        seen: set[str] = set()
        for job in self.jobs:
            if job.name in seen:
                raise ValueError(f"two jobs are named {job.name!r}")
            for dep in [*job.depends_on, *job.placeholders()]:
                if dep not in seen:
                    raise ValueError(f"job {job.name!r} needs {dep!r}, which is not earlier in the plan")
            for dep in job.placeholders():
                if not self[dep].ports:
                    raise ValueError(f"job {job.name!r} names the URL of {dep!r}, which has no port")
            seen.add(job.name)

    def __getitem__(self, name: str) -> JobSpec:
        for job in self.jobs:
            if job.name == name:
                return job
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [job.name for job in self.jobs]

    def waves(self) -> list[list[JobSpec]]:
        """Jobs grouped so that each group only depends on earlier groups (started together)."""
        level: dict[str, int] = {}
        for job in self.jobs:
            level[job.name] = 1 + max((level[d] for d in job.depends_on), default=-1)
        return [[j for j in self.jobs if level[j.name] == n] for n in range(max(level.values(), default=-1) + 1)]

    def only(self, *names: str) -> RunPlan:
        """A plan with just these jobs (dependencies on dropped jobs are dropped too)."""
        keep = [replace(j, depends_on=[d for d in j.depends_on if d in names])
                for j in self.jobs if j.name in names]
        return RunPlan(keep, name=self.name, backend=self.backend, uploads=list(self.uploads))

    def describe(self) -> str:
        head = f"Run plan {self.name!r} ({self.backend}): {len(self.jobs)} jobs"
        uploads = [f"[before the jobs] put {source} at {destination}"
                   for source, destination in self.uploads]
        return "\n".join([head, *uploads, *(job.describe() for job in self.jobs)])

    def to_dict(self) -> dict:
        """JSON-ready; secrets are names, so this is safe to write to disk."""
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# The recipe's plan
# ---------------------------------------------------------------------------------------------

PACKAGE_WHEEL = "<grpo_lab wheel>"
"""An upload source (`RunPlan.uploads`): a wheel of this grpo_lab checkout, built at submission."""

WHEELS_DIR = "wheels"
"""Folder of the bucket that carries the grpo_lab wheel to the HF jobs."""


def package_version() -> str:
    """This grpo_lab's version: from the checkout's pyproject.toml (what a wheel built from it
    gets), else from the installed package's metadata."""
    import tomllib
    from importlib.metadata import PackageNotFoundError, version

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        return tomllib.loads(pyproject.read_text())["project"]["version"]
    try:
        return version("grpo_lab")
    except PackageNotFoundError:
        return "0+unknown"


def package_wheel_name() -> str:
    """The file name `pip wheel` gives this grpo_lab (pure Python: py3-none-any)."""
    return f"grpo_lab-{package_version()}-py3-none-any.whl"


DEFAULT_TRAINER_ARGS = (
    "train-async", "--model", "{model}", "--server-url", "{proxy_url}",
    "--output-dir", "{output_dir}", "--lora-rank", "{lora_rank}",
    "--max-staleness", "{max_staleness}", "--bucket", "{output_dir}/adapters", "--resume",
)
"""`grpo-lab train-async` (grpo_lab.train_async). `--resume` makes a restarted trainer job (a
preemption) continue from its newest checkpoint; on a first start there is none."""


@dataclass
class RecipeConfig:
    """Parameters of `recipe_plan` (and flags of `grpo-lab launch`)."""

    backend: str = "local"
    """`local` (one process per job on this machine) or `hf-jobs` (one Hugging Face Job each)."""
    base_model: str | None = None
    """Base model the replicas serve and the trainer adapts (default: `tiny`, the offline tiny
    model, locally and on CPU flavors; Qwen/Qwen2.5-Math-1.5B, the blog's model, on GPUs)."""
    replicas: int = 2
    """Inference replicas behind the proxy."""
    lora_rank: int = 1
    """LoRA rank of the trained adapter (and the servers' --max-lora-rank)."""
    max_staleness: int = 4
    """Versions a sample may lag the trainer; servers hold max_staleness + 2 adapters."""
    bucket: str | None = None
    """Local directory (default: $GRPO_LAB_HOME/bucket) or hf://buckets/<owner>/<bucket>
    (required on HF Jobs)."""
    mount_path: str | None = None
    """Where every job sees the bucket (default /lora on HF Jobs; locally the directory itself,
    since processes on one machine already share paths)."""
    replica_flavor: str | None = None
    """HF Jobs flavor of each replica (default h200: `vllm serve`; a cpu-* flavor runs
    `grpo-lab serve`). Locally: `local`."""
    trainer_flavor: str | None = None
    """HF Jobs flavor of the trainer job, which also runs the proxy (default h200)."""
    engine: str | None = None
    """Replica server: `vllm` or `grpo-lab` (default: vllm on GPU flavors, grpo-lab otherwise)."""
    port: int = 8000
    """Port of each replica on HF Jobs, and of the proxy inside the trainer job. Locally every
    job gets a free port."""
    timeout: str = "4h"
    """Longest run of each HF job."""
    install: str | None = None
    """Shell command that installs grpo_lab in the HF jobs that run it. Default: a wheel of this
    checkout, built and copied into the bucket at submission (`<bucket>/<run>/wheels/`) and
    installed from the mount. Or e.g. `pip install git+https://github.com/<you>/grpo_lab`;
    `true` for an image that already has it."""
    run_name: str | None = None
    """Names the HF jobs and the run's folder in the bucket (default: recipe-<date>-<time>)."""
    health_timeout_s: float = 300.0
    """Local backend: how long to wait for each server's /health."""


def _vllm_replica_args(model: str, port: int, cfg: RecipeConfig) -> list[str]:
    return ["vllm", "serve", model, "--host", "0.0.0.0", "--port", str(port),
            "--enable-lora", "--max-lora-rank", str(cfg.lora_rank),
            "--max-loras", str(cfg.max_staleness + 2),
            "--logprobs-mode", "processed_logprobs",
            # the model card's sampling defaults (e.g. top_p) would apply to every rollout
            "--generation-config", "vllm"]


def _grpo_lab_replica_args(model: str, host: str, port: int, cfg: RecipeConfig, mount: str) -> list[str]:
    return ["serve", model, "--host", host, "--port", str(port),
            "--enable-lora", "--max-lora-rank", str(cfg.lora_rank),
            "--max-loras", str(cfg.max_staleness + 2),
            "--logprobs-mode", "processed_logprobs", "--allowed-lora-root", mount]


def proxy_args(upstreams: list[str], host: str, port: int, token_env: str | None) -> list[str]:
    """`grpo-lab proxy` arguments (after `grpo-lab`): one `--upstream` per replica."""
    args = ["proxy", "--host", host, "--port", str(port)]
    for url in upstreams:
        args += ["--upstream", url]
    return args + (["--upstream-token-env", token_env] if token_env else [])


def recipe_plan(config: RecipeConfig | None = None, *, trainer_args: tuple[str, ...] | list[str]
                = DEFAULT_TRAINER_ARGS, **fields) -> RunPlan:
    """docs/recipe.md's run as a plan: N replicas, a proxy, a trainer, one bucket.

    `trainer_args` follow `grpo-lab` in the trainer's command; `{model}`, `{proxy_url}`,
    `{output_dir}` (the run's folder in the bucket), `{lora_rank}` and `{max_staleness}` are
    filled in. Example: `recipe_plan(backend="hf-jobs", bucket="hf://buckets/me/lora")`.
    """
    cfg = replace(config or RecipeConfig(), **fields)
    if cfg.backend not in ("local", "hf-jobs"):
        raise ValueError(f"backend must be local or hf-jobs, got {cfg.backend!r}")
    if cfg.replicas < 1 or cfg.lora_rank < 1 or cfg.max_staleness < 0:
        raise ValueError("need replicas >= 1, lora_rank >= 1 and max_staleness >= 0")
    if cfg.engine not in (None, "vllm", "grpo-lab"):
        raise ValueError(f"engine must be vllm or grpo-lab, got {cfg.engine!r}")
    run_name = cfg.run_name or time.strftime("recipe-%Y%m%d-%H%M%S")
    if cfg.backend == "local":
        return _local_plan(cfg, run_name, list(trainer_args))
    return _hf_jobs_plan(cfg, run_name, list(trainer_args))


def _trainer_args(template: list[str], cfg: RecipeConfig, model: str, proxy_url: str, output_dir: str):
    values = {"model": model, "proxy_url": proxy_url, "output_dir": output_dir,
              "lora_rank": cfg.lora_rank, "max_staleness": cfg.max_staleness}
    return [arg.format(**values) for arg in template]


def _local_plan(cfg: RecipeConfig, run_name: str, trainer_template: list[str]) -> RunPlan:
    from .home import grpo_lab_home

    bucket = Path(cfg.bucket or grpo_lab_home() / "bucket").expanduser().absolute()
    if str(bucket).startswith("hf:"):
        raise ValueError("the local backend needs a local directory as its bucket")
    if cfg.mount_path not in (None, str(bucket)):
        raise ValueError("locally nothing is mounted: every process sees the bucket at its own "
                         f"path ({bucket}); leave mount_path unset")
    mount = str(bucket)
    model = cfg.base_model or "tiny"
    grpo_lab = [sys.executable, "-m", "grpo_lab.cli"]
    engine = cfg.engine or "grpo-lab"
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    jobs, upstreams = [], []
    for i in range(cfg.replicas):
        port = free_port()
        if engine == "vllm":
            command = _vllm_replica_args(model, port, cfg)
            command[command.index("0.0.0.0")] = "127.0.0.1"
        else:
            command = [*grpo_lab, *_grpo_lab_replica_args(model, "127.0.0.1", port, cfg, mount),
                       "--num-threads", "1"]
        url = f"http://127.0.0.1:{port}"
        upstreams.append(url)
        jobs.append(JobSpec(
            name=f"replica-{i}", command=command, env=dict(env),
            volumes=[BucketMount(mount, mount, read_only=True)], ports=[port],
            health_url=f"{url}/health", health_timeout_s=cfg.health_timeout_s))
    proxy_port = free_port()
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    jobs.append(JobSpec(
        name="proxy", command=[*grpo_lab, *proxy_args(upstreams, "127.0.0.1", proxy_port, None)],
        env={"PYTHONUNBUFFERED": "1"}, ports=[proxy_port], health_url=f"{proxy_url}/health",
        health_timeout_s=cfg.health_timeout_s, depends_on=[j.name for j in jobs]))
    trainer = _trainer_args(trainer_template, cfg, model, proxy_url, f"{mount}/{run_name}")
    jobs.append(JobSpec(
        name="trainer", command=[*grpo_lab, *trainer], env=dict(env),
        volumes=[BucketMount(mount, mount, read_only=False)], depends_on=["proxy"]))
    return RunPlan(jobs, name=run_name, backend="local")


def _hf_jobs_plan(cfg: RecipeConfig, run_name: str, trainer_template: list[str]) -> RunPlan:
    if not (cfg.bucket or "").startswith("hf://buckets/"):
        raise ValueError("HF Jobs need a Storage Bucket: bucket='hf://buckets/<owner>/<bucket>'")
    mount = cfg.mount_path or "/lora"
    replica_flavor = cfg.replica_flavor or "h200"
    model = cfg.base_model or (HF_BLOG_MODEL if is_gpu_flavor(replica_flavor) else "tiny")
    trainer_flavor = cfg.trainer_flavor or "h200"
    engine = cfg.engine or ("vllm" if is_gpu_flavor(replica_flavor) else "grpo-lab")
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1",
           "PYTHONUNBUFFERED": "1"}
    install, uploads = cfg.install, []
    if install is None:  # ship this checkout: a wheel in the run's folder of the bucket
        wheel = f"{run_name}/{WHEELS_DIR}/{package_wheel_name()}"
        uploads = [(PACKAGE_WHEEL, f"{cfg.bucket.rstrip('/')}/{wheel}")]
        # a mount may show a new file some seconds after the upload: wait for it (10 min at most)
        install = (f"for _ in $(seq 120); do test -f {mount}/{wheel} && break; sleep 5; done\n"
                   f"pip install --quiet {mount}/{wheel}")
    jobs = []
    for i in range(cfg.replicas):
        if engine == "vllm":
            command, image = _vllm_replica_args(model, cfg.port, cfg), VLLM_IMAGE
        else:  # a CPU job: install grpo_lab, then serve
            serve = shlex.join(["grpo-lab", *_grpo_lab_replica_args(model, "0.0.0.0", cfg.port, cfg, mount)])
            command, image = ["bash", "-c", f"set -e\n{install}\nexec {serve}\n"], CPU_IMAGE
        jobs.append(JobSpec(
            name=f"replica-{i}", command=command, env=dict(env), secrets=["HF_TOKEN"],
            volumes=[BucketMount(cfg.bucket, mount, read_only=True)], ports=[cfg.port],
            flavor=replica_flavor, image=image, timeout=cfg.timeout))
    # The trainer job: the proxy on 127.0.0.1 beside the trainer (it adds the bearer token that
    # exposed ports need), a wait until every replica answers through it, then the trainer.
    proxy_url = f"http://127.0.0.1:{cfg.port}"
    proxy = proxy_args([url_of(j.name) for j in jobs], "127.0.0.1", cfg.port, "HF_TOKEN")
    wait = ["python", "-m", "grpo_lab.launchers", "wait-healthy", f"{proxy_url}/health",
            "--timeout-s", "1800", "--pid"]
    trainer = _trainer_args(trainer_template, cfg, model, proxy_url, f"{mount}/{run_name}")
    script = "\n".join([
        "set -e",
        install,
        shell_join(["grpo-lab", *proxy]) + " &",
        shlex.join(wait) + " $!",
        "exec " + shlex.join(["grpo-lab", *trainer]),
        "",
    ])
    jobs.append(JobSpec(
        name="trainer", command=["bash", "-c", script], env={"PYTHONUNBUFFERED": "1"},
        secrets=["HF_TOKEN"], volumes=[BucketMount(cfg.bucket, mount, read_only=False)],
        flavor=trainer_flavor, image=VLLM_IMAGE if is_gpu_flavor(trainer_flavor) else CPU_IMAGE,
        timeout=cfg.timeout, depends_on=[j.name for j in jobs]))
    return RunPlan(jobs, name=run_name, backend="hf-jobs", uploads=uploads)

"""Job specs: a run's processes written down as data, before anything starts.

A `JobSpec` is one job (its command, environment, secrets, ports, the bucket as it sees it); a
`RunPlan` is an ordered list of `JobSpec`s. The same plan goes to either launcher:
`LocalLauncher` (grpo_lab.launch.local) runs each job as an OS process on this machine,
`HfJobsLauncher` (grpo_lab.launch.hf_jobs) submits each as a Hugging Face Job. The recipe's plan is
built in grpo_lab.launch.recipe_plan.

Secrets are names only (`HF_TOKEN`); launchers read their values from the environment when they
start a job, so no value is ever stored in a plan, printed, or written to disk.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

CPU_IMAGE = "python:3.12"
NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]*")
URL_PLACEHOLDER = re.compile(r"\{url:([a-z0-9][a-z0-9-]*)\}")


def url_of(job_name: str) -> str:
    """A placeholder for a job's URL, filled in by the launcher once the job exists.

    On HF Jobs a replica's URL (`https://<job_id>--8000.hf.jobs`) is known only after it is
    submitted, so the trainer job's command names it as `{url:replica-0}`. Locally it becomes
    `http://127.0.0.1:<first port>`.
    """
    return f"{{url:{job_name}}}"


def group_url(job_name: str, port: int) -> str:
    """A job's URL inside an HF Jobs network group: its alias behind the prefix the Hub puts in
    every member's environment (expanded by the shell of the job that calls it)."""
    return f"http://${{HF_NETWORK_GROUP_PREFIX}}{job_name}:{port}"


def network_group_name(run_name: str) -> str:
    """A run name as the Hub takes a network group's: lowercase alphanumerics and dashes, 46
    characters at most."""
    return re.sub(r"[^a-z0-9-]", "-", run_name.lower())[:46].strip("-") or "grpo-lab"


def shell_join(args: list[str]) -> str:
    """shlex.join, but a bare `{url:<job>}` placeholder stays unquoted (a URL needs no quotes)."""
    return " ".join(a if URL_PLACEHOLDER.fullmatch(a) else shlex.quote(a) for a in args)


def is_gpu_flavor(flavor: str) -> bool:
    """HF Jobs flavors are `cpu-*` or a GPU name (`t4-small`, `a10g-large`, `h200`, ...)."""
    return not (flavor == "local" or flavor.startswith("cpu"))


def flavor_gpus(flavor: str) -> int:
    """GPUs of an HF Jobs flavor, from its name: `h200x2` -> 2, `l4x4` -> 4, `a100-large` -> 1;
    a cpu-* flavor -> 0."""
    if not is_gpu_flavor(flavor):
        return 0
    found = re.search(r"x(\d+)$", flavor)
    return int(found.group(1)) if found else 1


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
            raise ValueError("mount_path must be an absolute path other than /, "
                             f"got {self.mount_path!r}")

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
            raise ValueError("job name must be lowercase letters, digits and dashes, "
                             f"got {self.name!r}")
        if not self.command:
            raise ValueError(f"job {self.name!r} has an empty command")
        for name in self.secrets:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"secret names are environment variable names, got {name!r}")
            if name in self.env:
                raise ValueError(f"{name} is both a secret and a plain env var "
                                 f"in job {self.name!r}")

    def placeholders(self) -> set[str]:
        """Jobs whose URL this job's command names."""
        return {m for arg in self.command for m in URL_PLACEHOLDER.findall(arg)}

    def describe(self) -> str:
        """Human-readable summary; secrets by name only."""
        where = ("this machine" if self.flavor == "local"
                 else f"flavor={self.flavor} image={self.image}")
        lines = [f"[{self.name}] {where}" + (f" timeout={self.timeout}" if self.timeout else "")]
        if self.depends_on:
            lines.append(f"  after:   {', '.join(self.depends_on)}")
        for v in self.volumes:
            mode = "read-only" if v.read_only else "read-write"
            lines.append(f"  bucket:  {v.source} at {v.mount_path} ({mode})")
        if self.ports:
            lines.append(f"  ports:   {', '.join(map(str, self.ports))}")
        if "CUDA_VISIBLE_DEVICES" in self.env:  # a local plan's devices (launch.local)
            lines.append(f"  gpus:    {self.env['CUDA_VISIBLE_DEVICES'] or 'none'}"
                         + _memory_share(self.command))
        if self.health_url:
            lines.append(f"  health:  {self.health_url} (wait up to {self.health_timeout_s:g} s)")
        if self.env:
            lines.append(f"  env:     {' '.join(f'{k}={v}' for k, v in self.env.items())}")
        if self.secrets:
            lines.append(f"  secrets: {', '.join(self.secrets)} (values from your environment)")
        lines.append(f"  command: {shlex.join(self.command)}")
        return "\n".join(lines)


def _memory_share(command: list[str]) -> str:
    """` (memory share 0.42)` for a replica given a part of its GPU's memory."""
    flag = "--gpu-memory-utilization"
    if flag in command[:-1]:
        return f" (memory share {command[command.index(flag) + 1]})"
    return ""


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
    network_group: str | None = None
    """HF Jobs: the network group every job joins, each claiming its name as an alias; a job
    then reaches another at `group_url` instead of its public exposed URL (None: public URLs)."""

    def __post_init__(self):
        seen: set[str] = set()
        for job in self.jobs:
            if job.name in seen:
                raise ValueError(f"two jobs are named {job.name!r}")
            for dep in [*job.depends_on, *job.placeholders()]:
                if dep not in seen:
                    raise ValueError(f"job {job.name!r} needs {dep!r}, "
                                     "which is not earlier in the plan")
            for dep in job.placeholders():
                if not self[dep].ports:
                    raise ValueError(f"job {job.name!r} names the URL of {dep!r}, "
                                     "which has no port")
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
        depth = max(level.values(), default=-1) + 1
        return [[j for j in self.jobs if level[j.name] == n] for n in range(depth)]

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
# The grpo_lab wheel as an upload: the HF Jobs launcher builds it at submission
# ---------------------------------------------------------------------------------------------

CHECKOUT = Path(__file__).resolve().parents[2]
"""The folder above the package: a source checkout (with pyproject.toml) or site-packages."""

PACKAGE_WHEEL = "<grpo_lab wheel>"
"""An upload source (`RunPlan.uploads`): a wheel of this grpo_lab checkout, built at submission."""


def package_version() -> str:
    """This grpo_lab's version: from the checkout's pyproject.toml (what a wheel built from it
    gets), else from the installed package's metadata."""
    import tomllib
    from importlib.metadata import PackageNotFoundError, version

    pyproject = CHECKOUT / "pyproject.toml"
    if pyproject.is_file():
        return tomllib.loads(pyproject.read_text())["project"]["version"]
    try:
        return version("grpo_lab")
    except PackageNotFoundError:
        return "0+unknown"


def package_wheel_name() -> str:
    """The file name `pip wheel` gives this grpo_lab (pure Python: py3-none-any)."""
    return f"grpo_lab-{package_version()}-py3-none-any.whl"


# ------------------------------------------------------------ how an HF job installs grpo_lab
# How an HF job installs grpo_lab: the wheel carried in the bucket, lean and retried.
#
# The plan (grpo_lab.launch.recipe_plan) copies a wheel of this checkout into the bucket before the
# first job; each job that runs grpo_lab installs it from its mount with `wheel_install`'s shell
# lines.


PIP_ATTEMPTS = 5
"""Times a job tries `pip install` (each with pip's own `--retries 5` per download): an index
that rate-limits the jobs' addresses must not lose the job, as in the reference's scripts."""

IMAGE_PINS = "/tmp/grpo-lab-image-pins.txt"
"""Where a job writes its image's own package versions (`pip list --format=freeze`) before
installing grpo_lab under them as constraints: pip then never moves a package the image's vLLM
was built against (it fails, naming the conflict, instead)."""

CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
"""Where a CPU image (no torch of its own) gets torch's CPU build, not the much larger CUDA one."""


def wheel_install(wheel: str, *, image_has_torch: bool, extra: tuple[str, ...] = (),
                  extras: tuple[str, ...] = ()) -> str:
    """Shell lines that install the grpo_lab wheel at `wheel` (a path on the bucket mount).

    Core dependencies only (`pip install <wheel>`, no extras: no notebook stack, no torch pin),
    so an image with torch (vLLM's) keeps its own; one without gets torch's CPU build. The
    mount may show the uploaded file some seconds late: wait for it (10 min at most). Then up
    to PIP_ATTEMPTS tries, 30 s apart, every package the image already has held at its version
    (IMAGE_PINS as `--constraint`). `extra`: more packages installed along with it; `extras`:
    the wheel's own optional extras (`tracking`: trackio and tensorboard)."""
    spec = shlex.quote(f"{wheel}[{','.join(extras)}]") if extras else wheel
    wheel_and_extra = " ".join([spec, *extra])
    index = "" if image_has_torch else f" --extra-index-url {CPU_TORCH_INDEX}"
    return "\n".join([
        f"for _ in $(seq 120); do test -f {wheel} && break; sleep 5; done",
        f"pip list --format=freeze > {IMAGE_PINS}",
        f"for attempt in $(seq {PIP_ATTEMPTS}); do",
        f"  pip install --quiet --retries 5 --constraint {IMAGE_PINS}{index} {wheel_and_extra}"
        " && break",
        f'  [ "$attempt" = {PIP_ATTEMPTS} ] && exit 1',
        f'  echo "pip install failed (attempt $attempt of {PIP_ATTEMPTS}); retrying in 30 s"; '
        'sleep 30',
        "done",
    ])

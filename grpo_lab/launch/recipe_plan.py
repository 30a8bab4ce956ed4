"""The recipe's plan: docs/recipe.md's run written down as a `RunPlan` (grpo_lab.launch.specs).

`recipe_plan()` builds it from a `RecipeConfig` (the flags of `grpo-lab launch`) for the local
backend (a process per job) or HF Jobs (a job each, grpo_lab installed from a wheel in the
bucket). The replicas start as the reference's `run_vllm_job.sh` starts vLLM; the proxy runs
inside the trainer job on HF Jobs, as a job of its own locally (docs/internals.md, "The plan";
docs/recipe.md, "Running the jobs"). Locally on GPUs each job is given its own
(grpo_lab.launch.local), or a share of one.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..proxy.config import proxy_args
from ..serve.process import GRPO_LAB
from ..util.argv import flag_args
from ..util.processes import free_port
from ..watch.reporters import report_targets
from .local import assign_devices, threads_per_process, visible_gpus
from .recipe_config import HF_BLOG_MODEL, PRESETS, RecipeConfig
from .replica_commands import (
    block_size_flags,
    grpo_lab_replica_args,
    lora_slots,
    max_lora_rank,
    vllm_cpu_replica,
    vllm_is_cpu_build,
    vllm_replica_args,
)
from .specs import (
    CPU_IMAGE,
    PACKAGE_WHEEL,
    BucketMount,
    JobSpec,
    RunPlan,
    is_gpu_flavor,
    network_group_name,
    package_wheel_name,
    shell_join,
    url_of,
    wheel_install,
)
from .trainer_args import (
    LOCAL_RUN_DIR,
    default_trainer_args,
    fsdp_launcher,
    trainer_launcher,
)

VLLM_IMAGE = "vllm/vllm-openai:v0.27.1"
"""Replica image on GPU flavors (pinned: the version the blog's LoRA path was validated on)."""

HF_HOME = "/tmp/hf"
"""The Hub cache inside HF jobs: a path every image can write to (the reference sets the same)."""

WHEELS_DIR = "wheels"
"""Folder of the bucket that carries the grpo_lab wheel to the HF jobs."""

ACCELERATE = (sys.executable, "-m", "accelerate.commands.accelerate_cli")
"""`accelerate` as this interpreter runs it: a local trainer on several GPUs starts under it."""


def preset_config(name: str, **fields) -> RecipeConfig:
    """The preset `name` as a RecipeConfig, `fields` replacing its values."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {sorted(PRESETS)}")
    return RecipeConfig(**{**PRESETS[name], **fields})


def recipe_plan(config: RecipeConfig | None = None, *,
                trainer_args: tuple[str, ...] | list[str] | None = None, **fields) -> RunPlan:
    """docs/recipe.md's run as a plan: N replicas, a proxy, a trainer, one bucket.

    `trainer_args` follow `grpo-lab` in the trainer's command (default: `default_trainer_args`
    for the backend and the trainer's flavor); `{model}`, `{proxy_url}`, `{output_dir}` (the
    run's folder in the bucket), `{lora_rank}`, `{max_staleness}`, `{device}` and
    `{max_completion_length}` are filled in.
    Example: `recipe_plan(backend="hf-jobs", bucket="hf://buckets/me/lora")`.
    """
    cfg = replace(config or RecipeConfig(), **fields)
    if cfg.backend not in ("local", "hf-jobs"):
        raise ValueError(f"backend must be local or hf-jobs, got {cfg.backend!r}")
    if cfg.replicas < 1 or cfg.lora_rank < 1 or cfg.max_staleness < 0:
        raise ValueError("need replicas >= 1, lora_rank >= 1 and max_staleness >= 0")
    if cfg.block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {cfg.block_size}")
    if cfg.trainer not in ("grpo-lab", "trl"):
        raise ValueError(f"trainer must be grpo-lab or trl, got {cfg.trainer!r}")
    if cfg.backend == "hf-jobs" and cfg.trainer == "trl" and not is_gpu_flavor(
            cfg.trainer_flavor or "h200"):
        raise ValueError(f"--trainer trl needs a GPU --trainer-flavor on HF Jobs: a "
                         f"{cfg.trainer_flavor} trainer runs in {CPU_IMAGE}, which has no vLLM, "
                         "and TRL's AsyncGRPOTrainer does not start without it (a GPU flavor runs "
                         f"in {VLLM_IMAGE}); or use --trainer grpo-lab on CPU flavors")
    if cfg.engine not in (None, "vllm", "grpo-lab"):
        raise ValueError(f"engine must be vllm or grpo-lab, got {cfg.engine!r}")
    max_lora_rank(cfg.lora_rank)  # a rank no server can hold fails here, not in a job
    max_loras, max_cpu_loras = lora_slots(cfg)
    if max_cpu_loras < max_loras:
        raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_staleness + 2 "
                         f"({max_loras}), as vLLM requires of --max-cpu-loras")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise ValueError("gpu_memory_utilization must be in (0, 1], "
                         f"got {cfg.gpu_memory_utilization}")
    if cfg.max_prompt_length < 1 or cfg.max_completion_length < 1:
        raise ValueError("need max_prompt_length >= 1 and max_completion_length >= 1")
    report_to = report_targets(cfg.report_to)
    if cfg.backend == "hf-jobs" and "trackio" in report_to and not cfg.trackio_space_id:
        raise ValueError("report_to trackio on HF Jobs needs --trackio-space-id: without a Space "
                         "trackio's file stays on the trainer job's disk, gone when it ends")
    run_name = cfg.run_name or time.strftime("recipe-%Y%m%d-%H%M%S")
    if cfg.backend == "local":
        return _local_plan(cfg, run_name, list(
            trainer_args or default_trainer_args("local", trainer=cfg.trainer)))
    gpu = is_gpu_flavor(cfg.trainer_flavor or "h200")
    return _hf_jobs_plan(cfg, run_name, list(
        trainer_args or default_trainer_args("hf-jobs", gpu, trainer=cfg.trainer)))


def _trainer_args(template: list[str], cfg: RecipeConfig, model: str, proxy_url: str,
                  output_dir: str, device: str = "auto"):
    values = {"model": model, "proxy_url": proxy_url, "output_dir": output_dir,
              "lora_rank": cfg.lora_rank, "max_staleness": cfg.max_staleness, "device": device,
              "max_completion_length": cfg.max_completion_length}
    args = [arg.format(**values) for arg in template]
    if _api_key_secrets() and args[:1] == ["train-async"]:  # the key by env var name, never argv
        args += ["--api-key-env", API_KEY_ENV]
    if args[:1] in (["train-async"], ["train-trl-async"]):  # --steps, ...: in place, or added
        for flag, value in zip(*[iter(flag_args(cfg.trainer_knobs()))] * 2):
            if flag in args:
                args[args.index(flag) + 1] = value
            else:
                args += [flag, value]
    report_to = report_targets(cfg.report_to)
    if report_to and args[:1] in (["train-async"], ["train-trl-async"]):
        args += flag_args({"report_to": ",".join(report_to),
                           "trackio_space_id": cfg.trackio_space_id})
    return args


API_KEY_ENV = "VLLM_API_KEY"
"""With it set where the plan is launched, the proxy requires it (as `vllm serve --api-key`) and
the trainer sends it; both jobs get it as a secret (its value never enters a plan or argv)."""


def _api_key_secrets() -> list[str]:
    return [API_KEY_ENV] if os.environ.get(API_KEY_ENV) else []


def _local_plan(cfg: RecipeConfig, run_name: str, trainer_template: list[str]) -> RunPlan:
    from ..util.home import grpo_lab_home

    bucket = Path(cfg.bucket or grpo_lab_home() / "bucket").expanduser().absolute()
    if str(bucket).startswith("hf:"):
        raise ValueError("the local backend needs a local directory as its bucket")
    if cfg.mount_path not in (None, str(bucket)):
        raise ValueError("locally nothing is mounted: every process sees the bucket at its own "
                         f"path ({bucket}); leave mount_path unset")
    mount = str(bucket)
    model = cfg.base_model or "tiny"
    engine = cfg.engine or "grpo-lab"
    # Devices (grpo_lab.launch.local): without a GPU every job on the CPU, one thread
    # each; with GPUs, a GPU per replica if there are enough and the rest to the trainer.
    devices = assign_devices(visible_gpus(), cfg.replicas, cfg.gpu_memory_utilization)
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if devices:  # the cores split between the processes, unless OMP_NUM_THREADS is set here
        del env["OMP_NUM_THREADS"]  # (then every job inherits the user's own)
        if "OMP_NUM_THREADS" not in os.environ:
            processes = cfg.replicas + len(devices["trainer"].gpus)
            env["OMP_NUM_THREADS"] = str(threads_per_process(processes))
    jobs, upstreams = [], []
    for i in range(cfg.replicas):
        port = free_port()
        replica_env = dict(env)
        device = devices.get(f"replica-{i}")
        if device:
            replica_env["CUDA_VISIBLE_DEVICES"] = device.cuda_visible_devices
        if engine == "vllm" and vllm_is_cpu_build():
            command, cpu_env = vllm_cpu_replica(model, port, cfg)
            replica_env.update(cpu_env)
        elif engine == "vllm":
            share = replace(cfg, gpu_memory_utilization=device.memory_fraction) if device else cfg
            command = vllm_replica_args(model, "127.0.0.1", port, share)
        else:  # on the CPU one thread; on a GPU torch's own threads and a share of its memory
            flags = ({"gpu_memory_utilization": device.memory_fraction} if device
                     else {"num_threads": 1})
            command = [*GRPO_LAB, *grpo_lab_replica_args(model, "127.0.0.1", port, cfg, mount,
                                                          **flags)]
        url = f"http://127.0.0.1:{port}"
        upstreams.append(url)
        jobs.append(JobSpec(
            name=f"replica-{i}", command=command, env=replica_env,
            volumes=[BucketMount(mount, mount, read_only=True)], ports=[port],
            health_url=f"{url}/health", health_timeout_s=cfg.health_timeout_s))
    proxy_port = free_port()
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    jobs.append(JobSpec(
        name="proxy", command=[*GRPO_LAB, *proxy_args(upstreams, "127.0.0.1", proxy_port,
                                                      **block_size_flags(cfg))],
        env={"PYTHONUNBUFFERED": "1"}, secrets=_api_key_secrets(), ports=[proxy_port],
        health_url=f"{proxy_url}/health",
        health_timeout_s=cfg.health_timeout_s, depends_on=[j.name for j in jobs]))
    trainer = _trainer_args(trainer_template, cfg, model, proxy_url, f"{mount}/{run_name}")
    trainer_env, launcher = dict(env), list(GRPO_LAB)
    if devices:
        trainer_env["CUDA_VISIBLE_DEVICES"] = devices["trainer"].cuda_visible_devices
        if len(devices["trainer"].gpus) > 1:  # one process per GPU, as an h200x2 trainer job
            launcher = fsdp_launcher(len(devices["trainer"].gpus), ACCELERATE,
                                     main_process_port=free_port())
    jobs.append(JobSpec(
        name="trainer", command=[*launcher, *trainer], env=trainer_env,
        secrets=_api_key_secrets(), volumes=[BucketMount(mount, mount, read_only=False)],
        depends_on=["proxy"]))
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
           "PYTHONUNBUFFERED": "1", "HF_HOME": HF_HOME}
    install, uploads = cfg.install, []
    trainer_image = VLLM_IMAGE if is_gpu_flavor(trainer_flavor) else CPU_IMAGE
    if install is None:  # ship this checkout: a wheel in the run's folder of the bucket
        wheel = f"{run_name}/{WHEELS_DIR}/{package_wheel_name()}"
        uploads = [(PACKAGE_WHEEL, f"{cfg.bucket.rstrip('/')}/{wheel}")]
    port = free_port if cfg.free_ports else (lambda: cfg.port)
    jobs = []
    for i in range(cfg.replicas):
        replica_port = port()
        if engine == "vllm":
            command, image = vllm_replica_args(model, "0.0.0.0", replica_port, cfg), VLLM_IMAGE
        else:  # a CPU job: install grpo_lab, then serve
            serve = shlex.join(["grpo-lab", *grpo_lab_replica_args(model, "0.0.0.0", replica_port,
                                                                    cfg, mount)])
            setup = install or wheel_install(f"{mount}/{wheel}", image_has_torch=False)
            command, image = ["bash", "-c", f"set -e\n{setup}\nexec {serve}\n"], CPU_IMAGE
        jobs.append(JobSpec(
            name=f"replica-{i}", command=command, env=dict(env), secrets=["HF_TOKEN"],
            volumes=[BucketMount(cfg.bucket, mount, read_only=True)], ports=[replica_port],
            flavor=replica_flavor, image=image, timeout=cfg.timeout))
    # The trainer job: the proxy on 127.0.0.1 beside the trainer (it adds the bearer token that
    # exposed ports need), a wait until every replica answers through it (the proxy's /health
    # is 200 only when every replica's is), then the trainer.
    proxy_port = port()
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    proxy = proxy_args([url_of(j.name) for j in jobs], "127.0.0.1", proxy_port,
                       upstream_token_env="HF_TOKEN", **block_size_flags(cfg))
    # python3, never python: the vLLM image links only python3 (vLLM's docker/Dockerfile,
    # update-alternatives), and the reference's job scripts call python3 too
    wait = ["python3", "-m", "grpo_lab.launch.local", "wait-healthy", f"{proxy_url}/health",
            "--timeout-s", "1800", "--pid"]
    trainer = _trainer_args(trainer_template, cfg, model, proxy_url, f"{mount}/{run_name}",
                            device="cuda" if is_gpu_flavor(trainer_flavor) else "cpu")
    if trainer[:1] == ["train-async"] and "--local-dir" not in trainer:  # arguments after `--`
        trainer += ["--local-dir", LOCAL_RUN_DIR]  # the mount takes whole-file writes only
    script = "\n".join([
        "set -e",
        install or wheel_install(f"{mount}/{wheel}", image_has_torch=trainer_image == VLLM_IMAGE,
                                 extra=("kernels",) if cfg.trainer == "trl"
                                 and trainer_image == VLLM_IMAGE else (),
                                 extras=(*(("trl",) if cfg.trainer == "trl" else ()),
                                         *(("tracking",) if report_targets(cfg.report_to)
                                           else ()))),
        shell_join(["grpo-lab", *proxy]) + " &",
        shlex.join(wait) + " $!",
        # One process per GPU: `accelerate launch` with FSDP2 on h200x2 and the like.
        "exec " + shlex.join([*trainer_launcher(trainer_flavor), *trainer]),
        "",
    ])
    jobs.append(JobSpec(
        name="trainer", command=["bash", "-c", script],
        env={"PYTHONUNBUFFERED": "1", "HF_HOME": HF_HOME},
        secrets=["HF_TOKEN", *_api_key_secrets()],
        volumes=[BucketMount(cfg.bucket, mount, read_only=False)],
        flavor=trainer_flavor, image=trainer_image,
        timeout=cfg.timeout, depends_on=[j.name for j in jobs]))
    return RunPlan(jobs, name=run_name, backend="hf-jobs", uploads=uploads,
                   network_group=network_group_name(run_name) if cfg.network_group else None)

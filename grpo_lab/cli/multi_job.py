"""`grpo-lab demo --jobs local`: the recipe's separate jobs on this machine, end to end.

    replica-0 ─┐
               ├─> proxy ─> trainer (`grpo-lab train-async`)      one process each (LocalLauncher)
    replica-1 ─┘                 │
           <── load policy-vN ───┘ adapters through <run>/bucket/, a plain local folder

The plan is `recipe_plan(backend="local")`, the one `grpo-lab launch` starts, with the trainer's
hyperparameters appended. This process only watches: a progress bar fed by the trainer's
metrics.jsonl, then a summary table and the run folder (summary.json, plots, logs/, plan.json,
bucket/train/ with the metrics, syncs, adapters and checkpoints).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from dataclasses import fields
from datetime import datetime
from pathlib import Path

from ..launch.local import LocalLauncher
from ..launch.recipe_plan import recipe_plan
from ..launch.trainer_args import DEFAULT_TRAINER_ARGS
from ..model.pretrained import SMOLLM2, smollm2_path
from ..serve.prefix_cache import DEFAULT_BLOCK_SIZE
from ..train.async_config import AsyncGRPOConfig
from ..util.argv import flag_args
from ..util.files import JsonlTail
from ..watch.live_stats import proxy_stats, replica_cache_stats
from ..watch.metrics import plot_training, read_metrics
from ..watch.plots import plot_pipeline
from .flags import config_from_args, given_flags

DEFAULT_MIN_GAIN = 0.20
"""The accuracy gain (held-out, greedy) the demo's summary reports against when none is given."""

RUN_NAME = "train"
"""The trainer's folder inside the bucket."""


MULTI_JOB_DEFAULTS = dict(max_staleness=1, eval_every=0, steps=145, learning_rate=2e-3,
                          lr_scheduler_type="linear", lora_rank=4, temperature=0.7)
"""Where `grpo-lab demo --jobs local` differs from the config's defaults (a flag given on the
command line wins): sized for 2 CPU cores shared by four processes and for its targets (+20
points in at most 60 s of training). The measurements behind each value:
benchmarks/results/README.md."""


TINY_BLOCK_SIZE = 4
"""KV block size of the demo's replicas and proxy on the tiny model: its prompts ("53+05=" and a
BOS) are 7 tokens, so at vLLM's 16 nothing would be routed by prefix or cached. The demo asks for
a prompt's G completions in one request (n = G; why: benchmarks/results/README.md)."""


def multi_job_config(args) -> AsyncGRPOConfig:
    """The demo's AsyncGRPOConfig: MULTI_JOB_DEFAULTS for every flag not given on the command
    line (a given flag wins, even where its value is the config's default)."""
    config = config_from_args(args, AsyncGRPOConfig)
    given = given_flags(args)
    for name, value in MULTI_JOB_DEFAULTS.items():
        if name not in given:
            setattr(config, name, value)
    return config


def trainer_flags(config: AsyncGRPOConfig) -> list[str]:
    """Every config field that differs from the default, as `--flag value` (the plan fills in
    model, output dir, lora rank and max staleness itself)."""
    skip = {"model", "output_dir", "lora_rank", "max_staleness", "progress"}
    default = AsyncGRPOConfig()
    changed = {f.name: getattr(config, f.name) for f in fields(AsyncGRPOConfig)
               if f.name not in skip and getattr(config, f.name) != getattr(default, f.name)}
    return flag_args({**changed, "progress": False})


def _follow(launcher: LocalLauncher, metrics: Path, total: int, progress: bool,
            timeout_s: float, on_step=None) -> None:
    """A progress bar from the trainer's metrics.jsonl until the trainer exits."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc="async GRPO", disable=not progress)
    deadline = time.monotonic() + timeout_s
    tail, steps = JsonlTail(metrics), {}  # step -> its latest record (a resume logs some again)
    try:
        while True:
            running = launcher.running("trainer")  # asked before the read: no line is missed
            new = [r for r in tail.read_new() if r.get("step", 0) > 0]
            if new:
                r = new[-1]
                steps.update((s["step"], s) for s in new)
                bar.update(len(steps) - bar.n)
                bar.set_postfix(reward=f"{r['reward']:.2f}",
                                stale=f"{r.get('sample/staleness_mean', 0):.1f}",
                                queue=f"{r.get('sample/rollout_queue_size', 0):g}")
            if on_step is not None and new:
                on_step(launcher, new[-1])
            if not running:
                return
            # A replica may die: the proxy takes it out and the trainer goes on with the others.
            if not launcher.running("proxy"):
                raise RuntimeError(f"the proxy exited:\n{launcher.logs('proxy')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the trainer is still running after {timeout_s:g} s")
            time.sleep(0.5)
    finally:
        bar.close()


def run_multi_job_demo(config: AsyncGRPOConfig, *, replicas: int = 2, timeout_s: float = 900,
                       min_gain: float = DEFAULT_MIN_GAIN, on_step=None,
                       engine: str = "grpo-lab") -> dict:
    """Start the jobs, follow the trainer, then print and return the summary.

    `engine`: the replicas' server, `grpo-lab` (`grpo-lab serve`) or `vllm` (real vLLM, its CPU
    build here: grpo_lab.serve.process; 16-token KV blocks, 1-3 minutes to start).

    `on_step(launcher, record)`: called with the newest metrics record while the trainer runs
    (a test kills a replica from there)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run_dir = Path(config.output_dir or Path("runs") / datetime.now().strftime(
        "demo-jobs-%Y%m%d-%H%M%S")).absolute()
    if (run_dir / "plan.json").exists():  # its trainer would resume that run's last checkpoint
        raise ValueError(f"{run_dir} already holds a demo run (its plan.json): pass a new "
                         "--output-dir, or none for a fresh folder under runs/")
    run_dir.mkdir(parents=True, exist_ok=True)
    config.run_name = config.run_name or run_dir.name  # the trainer's, with --report-to
    bucket = run_dir / "bucket"
    model_name = config.model  # before it becomes a folder
    block_size = DEFAULT_BLOCK_SIZE  # vLLM's default
    if config.model == "tiny":
        # Build (or find) the model once, here, with every core, before any job starts: else
        # each replica and the trainer would build it at the same time on one thread each.
        from ..model.tiny_model import TinyModelRecipe, tiny_model_path

        recipe = TinyModelRecipe(task=config.task, difficulty=config.difficulty)
        config.model = str(tiny_model_path(recipe, progress=config.progress,
                                           num_threads=os.cpu_count()))
        # vLLM's CPU attention takes multiples of 16 only: the tiny prompts fill no block there
        block_size = TINY_BLOCK_SIZE if engine == "grpo-lab" else DEFAULT_BLOCK_SIZE
    elif config.model == SMOLLM2:  # made once from its wheel here, before any job starts
        config.model = str(smollm2_path(progress=config.progress))
    if engine == "vllm":
        from ..serve.process import STARTUP_TIMEOUT_S, vllm_missing_reason

        if vllm_missing_reason():
            raise RuntimeError(vllm_missing_reason())
    plan = recipe_plan(backend="local", replicas=replicas, lora_rank=config.lora_rank,
                       max_staleness=config.max_staleness, bucket=str(bucket), run_name=RUN_NAME,
                       base_model=config.model, engine=engine, block_size=block_size,
                       health_timeout_s=180 if engine == "grpo-lab" else STARTUP_TIMEOUT_S,
                       trainer_args=(*DEFAULT_TRAINER_ARGS, *trainer_flags(config)))
    out = bucket / RUN_NAME
    proxy_url = f"http://127.0.0.1:{plan['proxy'].ports[0]}"
    start = time.perf_counter()
    with LocalLauncher(plan, run_dir) as launcher:
        ready = time.perf_counter()
        _follow(launcher, out / "metrics.jsonl", config.steps, config.progress, timeout_s,
                on_step)
        code = launcher.procs["trainer"].wait(timeout=30)
        stats = proxy_stats(proxy_url)
        cache = replica_cache_stats([f"http://127.0.0.1:{plan[name].ports[0]}"
                                     for name in plan.names if name.startswith("replica")])
        status = launcher.status()
    wall = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"the trainer failed with code {code}:\n"
                           f"{(run_dir / 'logs' / 'trainer.log').read_text()[-3000:]}")
    trained = json.loads((out / "summary.json").read_text())
    records = read_metrics(out / "metrics.jsonl")
    steps = [r for r in records if r.get("step", 0) > 0]
    router = stats.get("router", stats)
    ratios = [r["ratio"] for r in steps if "ratio" in r]
    summary = {
        "jobs": plan.names, "replicas": replicas, "engine": engine, "model": model_name,
        "status": status,
        "accuracy_before": trained["accuracy_before"], "accuracy_after": trained["accuracy_after"],
        "accuracy_gain": trained["accuracy_after"] - trained["accuracy_before"],
        "steps": trained["steps"], "samples": trained["samples"],
        "syncs": trained["syncs"], "sync_p50_s": trained["sync_p50_s"],
        "router": {k: router.get(k) for k in ("routed", "affinity", "spilled", "unmatched")},
        "prefix_cache": cache, "block_size": block_size,
        "proxy": {k: stats.get(k) for k in ("marked_down", "rerouted", "errors", "down_reasons")},
        "retried_requests": trained["retried_requests"], "groups": trained["groups"],
        "ratio_min": min(ratios), "ratio_max": max(ratios),
        "staleness_mean": statistics.fmean(r["sample/staleness_mean"] for r in steps),
        "staleness_max": max(r["sample/staleness_max"] for r in steps),
        "dropped_stale": trained["groups"]["dropped_stale"],
        "startup_s": round(ready - start, 1), "train_s": trained["seconds"],
        "wall_s": round(wall, 1), "run_dir": str(run_dir),
        "findings": trained.get("findings", []),  # the run doctor's, in the trainer's run
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_pipeline(records).savefig(run_dir / "pipeline.png", dpi=90)
    training = plot_training(records, title="grpo-lab demo --jobs local",
                             keys=("reward", "eval/accuracy", "ratio"))
    training.savefig(run_dir / "training.png", dpi=90)
    print_summary(summary, min_gain)
    return summary


def print_summary(s: dict, min_gain: float) -> None:
    rows = [
        ("jobs", ", ".join(s["jobs"]) + f" (replicas: {s.get('engine', 'grpo-lab')})"),
        ("greedy accuracy", f"{s['accuracy_before']:.1%} -> {s['accuracy_after']:.1%} "
                            f"({100 * s['accuracy_gain']:+.1f} points)"),
        ("steps / samples", f"{s['steps']} / {s['samples']}"),
        ("weight syncs", f"{s['syncs']}, p50 {s['sync_p50_s']:.3f} s"),
        ("router", " ".join(f"{k} {v}" for k, v in s["router"].items())),
        ("prefix cache", prefix_cache_line(s["prefix_cache"], s["block_size"])),
        ("ratio range", f"{s['ratio_min']:.4f} .. {s['ratio_max']:.4f}"),
        ("staleness", f"mean {s['staleness_mean']:.2f}, max {s['staleness_max']:g}, "
                      f"groups dropped {s['dropped_stale']}"),
        ("time", f"{s['wall_s']:.0f} s ({s['startup_s']:.0f} s start-up, "
                 f"{s['train_s']:.0f} s training)"),
        ("run folder", s["run_dir"]),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n" + "=" * 72)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    codes = [f["code"] for f in s.get("findings", [])]
    print(f"{'run doctor':<{width}}  " + (", ".join(codes) if codes else "no findings"))
    print("targets (2 CPU cores):")
    for line in demo_verdicts(s, min_gain):
        print(f"  {line}")
    print("=" * 72)


def prefix_cache_line(cache: dict, block_size: int = DEFAULT_BLOCK_SIZE) -> str:
    """The replicas' prefix-cache hits, in prompt tokens (what affinity routing is for)."""
    if not cache.get("cache_queries"):
        return "no prompt tokens queried"
    gone = f"; {len(cache['unreachable'])} replica(s) gone" if cache.get("unreachable") else ""
    return (f"{cache['cache_hits']:.0f} of {cache['cache_queries']:.0f} prompt tokens cached "
            f"({cache['cache_hit_rate']:.0%}; "
            f"only whole {block_size}-token blocks are cached{gone})")


DEMO_TARGETS = {"train_s": 60.0, "startup_s": 20.0}
"""What `grpo-lab demo` aims for on 2 CPU cores once the tiny model is built: training at most
60 s, start-up (every job healthy) at most 20 s; the accuracy gain's target is `min_gain`."""


def demo_verdicts(s: dict, min_gain: float) -> list[str]:
    """One line per target: the target, this run's value, met or not."""
    def mark(ok: bool) -> str:
        return "met" if ok else "NOT met"

    gain = (f"greedy accuracy gain >= {100 * min_gain:+.0f} points: "
            f"{100 * s['accuracy_gain']:+.1f} ({mark(s['accuracy_gain'] >= min_gain)})")
    if s.get("model", "tiny") != "tiny":
        return [gain, "time: no target (the targets are the tiny model's demo's)"]
    return [
        gain,
        f"training <= {DEMO_TARGETS['train_s']:.0f} s: {s['train_s']:.0f} s "
        f"({mark(s['train_s'] <= DEMO_TARGETS['train_s'])})",
        f"start-up <= {DEMO_TARGETS['startup_s']:.0f} s: {s['startup_s']:.0f} s "
        f"({mark(s['startup_s'] <= DEMO_TARGETS['startup_s'])})",
    ]


class KillAt:
    """An `on_step` callback for `run_multi_job_demo`: SIGKILL job
    `name`'s process group, as a reclaimed machine goes, once the trainer has logged `step`.
    `killed_at`: the step it was killed after (None while it lives)."""

    def __init__(self, name: str, step: int):
        self.name, self.step, self.killed_at = name, step, None

    def __call__(self, launcher, record: dict) -> None:
        if self.killed_at is None and record.get("step", 0) >= self.step:
            os.killpg(launcher.procs[self.name].pid, signal.SIGKILL)
            self.killed_at = record["step"]


def run_with_replica_killed(kill_at_step: int, *, steps: int, output_dir: str | Path,
                            max_staleness: int = 1, eval_size: int = 32) -> dict:
    """A short `grpo-lab demo --jobs local` run (two replicas, the proxy, a trainer) in which
    replica-0 gets a SIGKILL once the trainer has logged `kill_at_step` (notebook 07's exercise).
    Returns the run's status of every job, its steps, the router's and the proxy's counters, the
    step of the kill and the survivor's (replica-1's) share of the routed requests."""
    import matplotlib.pyplot as plt

    config = AsyncGRPOConfig(steps=steps, eval_size=eval_size, eval_every=0, progress=False,
                             max_staleness=max_staleness, output_dir=str(output_dir))
    kill, figures = KillAt("replica-0", kill_at_step), set(plt.get_fignums())
    summary = run_multi_job_demo(config, on_step=kill, min_gain=0.0)
    for number in set(plt.get_fignums()) - figures:  # its plots went to files, not here
        plt.close(number)
    routed = summary["router"]["routed"]
    return {"status": summary["status"], "steps": summary["steps"], "router": summary["router"],
            "proxy": {k: summary["proxy"][k] for k in ("marked_down", "rerouted")},
            "killed_at": kill.killed_at, "survivor_share": routed[1] / sum(routed)}

"""`grpo-lab launch`: docs/recipe.md's multi-job run, built as a plan (grpo_lab.launch.recipe_plan),
then printed (--dry-run), run here or submitted to Hugging Face Jobs.

    grpo-lab launch --dry-run                        the local plan and its shell lines
    grpo-lab launch --backend hf-jobs --bucket hf://buckets/me/lora --dry-run
    grpo-lab launch --cancel RUN                     cancel every HF job of a run
    grpo-lab launch --preset blog --dry-run         the blog's run (docs/recipe.md) on HF Jobs
    grpo-lab launch --preflight ...                  two CPU jobs check the mount and the port
                                                     first; the recipe starts only if all pass

The local backend runs the jobs with `LocalLauncher` (grpo_lab.launch.local) until the trainer
exits; hf-jobs submits them with `HfJobsLauncher` (grpo_lab.launch.hf_jobs), then follows the run
and cancels every job when the trainer ends (grpo_lab.launch.follow), or returns (--detach).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from dataclasses import fields, replace
from pathlib import Path

from ..launch.follow import cancel_run, launch_hf_jobs
from ..launch.hf_jobs import hf_jobs_commands
from ..launch.local import LaunchError, LocalLauncher, local_commands
from ..launch.preflight import preflight_plan, run_preflight
from ..launch.recipe_plan import PRESETS, RecipeConfig, preset_config, recipe_plan
from ..launch.specs import is_gpu_flavor
from ..launch.trainer_args import default_trainer_args, dropped_flags
from .flags import BOOL_FLAG, add_config_flags, config_from_args, field_docs, given_flags


def add_parser(sub) -> None:
    """Add `grpo-lab launch` to the CLI's subparsers."""
    launch = sub.add_parser(
        "launch", help="docs/recipe.md's multi-job run: replicas, proxy, trainer, one bucket",
        description="Start the recipe's jobs locally (one process each) or on Hugging Face "
                    "Jobs. Arguments after `--` replace the trainer's grpo-lab arguments.")
    launch.add_argument("--backend", choices=("local", "hf-jobs"), default="local",
                        help=field_docs(RecipeConfig)["backend"])
    add_config_flags(launch, RecipeConfig, exclude=("backend",))
    launch.add_argument("--dry-run", default=False, **BOOL_FLAG,
                        help="print the plan and the equivalent commands; start nothing")
    launch.add_argument("--run-dir", default=None,
                        help="local backend: folder for logs and plan.json "
                        "(default: runs/<run-name>)")
    launch.add_argument("--namespace", default=None, help="hf-jobs: user or org running the jobs")
    launch.add_argument("--detach", default=False, **BOOL_FLAG,
                        help="hf-jobs: submit and return instead of following the run (the "
                             "jobs bill until they end or time out; `--cancel RUN` stops them)")
    launch.add_argument("--cancel", default=None, metavar="RUN",
                        help="hf-jobs: cancel every job of run RUN that still bills, then exit")
    launch.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="a named run (grpo_lab.launch.recipe_plan.PRESETS; `blog`: the blog's "
                             "run, docs/recipe.md); flags set to other values than their defaults "
                             "replace the preset's")
    launch.add_argument("--preflight", default=False, **BOOL_FLAG,
                        help="first run two cheap CPU jobs (grpo_lab.launch.preflight) that check "
                             "the bucket mount (directory rename, whole-file writes, the lag of "
                             "one job's write in another's mount) and the replica's port with "
                             "bearer auth; print their report, then start the recipe's jobs "
                             "only if every check passed (exit 1 otherwise)")
    launch.add_argument("--preflight-only", default=False, **BOOL_FLAG,
                        help="run the preflight jobs, print their report and exit (1 if a check "
                             "failed); start nothing else")
    launch.add_argument("trainer_args", nargs="*",
                        help="after `--`: the trainer's grpo-lab arguments, with {model}, "
                             "{proxy_url}, {output_dir}, {lora_rank}, {max_staleness}, {device}, "
                             "{max_completion_length} filled in")
    launch.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`grpo-lab launch`: build the plan, then print it (--dry-run), run it, or submit it."""
    try:
        return _launch(args)
    except LaunchError as exc:  # a job failed to start: its log tail, no traceback
        print(f"grpo-lab launch: {exc}", file=sys.stderr)
        return 1


DRY_RUN_BUCKET = "hf://buckets/<you>/grpo-lab"
"""The bucket a dry run shows when none is given."""


def _changed_fields(config: RecipeConfig) -> dict:
    """The fields whose value is not RecipeConfig's default (the flags given on the command
    line)."""
    default = RecipeConfig()
    return {f.name: getattr(config, f.name) for f in fields(RecipeConfig)
            if getattr(config, f.name) != getattr(default, f.name)}


def _forecast_lines(config: RecipeConfig, extra: dict, mount_lag_s: float | None = None) -> str:
    """The planner's prediction for this exact plan (grpo_lab.plan.planner.forecast_plan), as
    shell comments: the dry run's lines stay a script `bash -n` accepts. `mount_lag_s`: the
    preflight's measured lag, in place of the blog's."""
    from ..plan.planner import forecast_plan

    try:
        text = forecast_plan(config, mount_lag_s=mount_lag_s).describe()
        if extra:
            text += ("\n(trainer arguments given after `--`: simulated with the blog's settings "
                     "and launch's own --steps, --max-inflight and --token-budget)")
    except (ValueError, KeyError) as exc:  # a model or flavor the planner does not know
        text = f"no forecast: {exc}"
    return "\n".join(f"# {line}" if line else "#" for line in
                     ["forecast (grpo-lab plan's simulator; `grpo-lab plan` to search):",
                      *text.splitlines()])


TIMEOUT_MARGIN, TIMEOUT_SLACK_S = 1.5, 1800.0
"""A job's `--timeout` when none is given, on GPU flavors: the forecast wall clock x 1.5 + 30
minutes (the simulator's median error over the blog's 29 figures is 16 %, its worst about 40 %;
FORECAST_BAND, the printed band, is its largest on the runs it was not calibrated on)."""


def timeout_seconds(text: str) -> float:
    """HF Jobs' timeout (`4h`, `90m`, `3600s`, `3600`) in seconds."""

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
    if not match:
        raise ValueError(f"timeout {text!r}: a number with s, m, h or d (e.g. 4h, 90m)")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def timeout_from_forecast(config: RecipeConfig, wall_clock_s: float, given: bool
                          ) -> tuple[RecipeConfig, str]:
    """(config, what was done): without a given --timeout, the forecast's wall clock with a
    margin; with one, a ValueError when the forecast itself does not fit in it."""
    if given:
        if wall_clock_s > timeout_seconds(config.timeout):
            raise ValueError(f"the forecast wall clock ({wall_clock_s / 3600:.1f} h) is longer "
                             f"than --timeout {config.timeout}: the jobs would be killed before "
                             "the run ends. Raise --timeout, or shorten the run")
        return config, f"--timeout {config.timeout} (given; the forecast is " \
                       f"{wall_clock_s / 3600:.1f} h)"
    minutes = int(-(-(wall_clock_s * TIMEOUT_MARGIN + TIMEOUT_SLACK_S) // 60))
    return replace(config, timeout=f"{minutes}m"), (
        f"--timeout {minutes}m: the forecast wall clock ({wall_clock_s / 3600:.1f} h) x "
        f"{TIMEOUT_MARGIN} + {TIMEOUT_SLACK_S / 60:.0f} min")


def _launch(args: argparse.Namespace) -> int:
    if args.cancel:
        return cancel_run(args.cancel, namespace=args.namespace)
    config = config_from_args(args, RecipeConfig)
    if args.preset:
        config = preset_config(args.preset, **_changed_fields(config))
    if args.dry_run and config.backend == "hf-jobs" and not config.bucket:
        config = replace(config, bucket=DRY_RUN_BUCKET)
        print(f"(no --bucket given: shown with {DRY_RUN_BUCKET})")
    extra = {"trainer_args": args.trainer_args} if args.trainer_args else {}
    plan = recipe_plan(config, **extra)
    if args.trainer_args:  # they replace the default ones whole: say what no longer goes
        default = default_trainer_args(plan.backend, is_gpu_flavor(plan["trainer"].flavor),
                                       trainer=config.trainer)
        if dropped := dropped_flags(args.trainer_args, default):
            print(f"grpo-lab launch: the trainer's arguments after `--` replace its default "
                  f"ones, and leave out {' '.join(dropped)}: the trainer runs with its own "
                  "defaults for those"
                  + (" (without --local-dir, appending metrics.jsonl to a bucket mount fails)"
                     if "--local-dir" in dropped else ""), file=sys.stderr)
    if plan.backend == "hf-jobs" and is_gpu_flavor(plan["trainer"].flavor):
        from ..plan.planner import forecast_plan

        given = "timeout" in given_flags(args) or bool(args.preset)
        try:
            wall_clock_s = forecast_plan(config).wall_clock_s
        except (ValueError, KeyError) as exc:  # a model or flavor the planner does not know
            wall_clock_s = None
            print(f"timeout: --timeout {config.timeout} ({'given' if given else 'the default'}; "
                  f"no forecast to check it against: {exc}). A run that may take longer needs "
                  "a longer --timeout: HF Jobs stops each job at it")
        if wall_clock_s is not None:
            try:
                config, how = timeout_from_forecast(config, wall_clock_s, given)
            except ValueError as exc:
                print(f"grpo-lab launch: {exc}", file=sys.stderr)
                return 2
            plan = recipe_plan(config, **extra)
            print(f"timeout: {how}")
    run_dir = Path(args.run_dir or Path("runs") / plan.name)
    preflight = args.preflight or args.preflight_only
    if preflight:  # the preflight's folder in the bucket: the run's own
        config = replace(config, run_name=plan.name)
    if args.dry_run:
        if preflight:
            print(preflight_plan(config).plan.describe(), end="\n\n")
        print(plan.describe(), end="\n\n")
        if plan.backend == "hf-jobs" and is_gpu_flavor(plan["trainer"].flavor):
            print(_forecast_lines(config, extra), end="\n\n")
        if plan.backend == "local":
            print(local_commands(plan, run_dir))
        else:
            print(hf_jobs_commands(plan, args.namespace))
        return 0
    if preflight:  # before any GPU is paid for: nothing of the recipe starts if a check fails
        options = {"namespace": args.namespace} if args.namespace else {}
        report = run_preflight(config, run_dir=run_dir / "preflight", launcher_options=options)
        print(report.describe(), flush=True)
        if not report.ok:
            print("grpo-lab launch: a preflight check failed; the recipe's jobs were not started",
                  file=sys.stderr)
            return 1
        if report.sync_lag_s is not None and plan.backend == "hf-jobs" and \
                is_gpu_flavor(plan["trainer"].flavor):  # the forecast with the measured lag
            print(_forecast_lines(config, extra, mount_lag_s=report.sync_lag_s), flush=True)
        if args.preflight_only:
            return 0
    if plan.backend == "hf-jobs":
        return launch_hf_jobs(plan, namespace=args.namespace, detach=args.detach)
    # Local: stop the jobs on SIGTERM too (`kill <pid>` of this command), not only on Ctrl-C
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    print(f"starting {', '.join(plan.names)}; logs in {run_dir / 'logs'}", flush=True)
    try:
        with LocalLauncher(plan, run_dir) as run:
            print(json.dumps(run.status(), indent=2), flush=True)
            code = run.wait("trainer")
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"trainer exited with code {code}")
    return code

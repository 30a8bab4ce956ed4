"""`grpo-lab plan`: the HF Jobs plan to pay for, chosen before anything starts
(grpo_lab.plan.planner: the pipeline simulator over a grid of flavors and settings).

    grpo-lab plan --preset blog                     the blog's run: h200 replicas, h200x2 trainer
    grpo-lab plan --model qwen2.5-0.5b --single-gpu --deadline-h 2
    grpo-lab plan --params 7e9 --budget-usd 100 --json
    grpo-lab plan --preset blog --mount-lag-s 31      a preflight's measured mount lag

It prints the recommendation (flavors, replicas, in-flight cap, token budget, max_staleness),
the predicted step time, wall clock, cost and bottleneck, and the memory check.
"""

from __future__ import annotations

import argparse
import json

from .flags import BOOL_FLAG

PRESET_FLAVORS = {"blog": ("h200", "h200x2")}
"""--preset NAME: its replica and trainer flavors (grpo_lab.launch.recipe_config.PRESETS)."""
RECIPE_FLAGS = ("prompts_per_step", "num_generations", "weight_sync_steps")
"""The recipe's settings `grpo-lab plan` takes (PipelineSetting fields; the blog's by default)."""


def _names(text: str | None) -> list[str] | None:
    return [n.strip() for n in text.split(",") if n.strip()] if text else None


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def add_parser(sub) -> None:
    """Add `grpo-lab plan` to the CLI's subparsers."""
    plan = sub.add_parser(
        "plan", help="choose HF Jobs flavors, replicas and settings for a budget or deadline",
        description="Search replica and trainer flavors, replica counts, the in-flight cap, the "
                    "token budget and max_staleness through the pipeline simulator; print the "
                    "cheapest plan that meets --deadline-h, or the fastest within --budget-usd.")
    model = plan.add_mutually_exclusive_group()
    model.add_argument("--model", default=None,
                       help="a shape (qwen2.5-0.5b, qwen2.5-math-1.5b), its hub id, or a local "
                            "model folder (its config.json); default: the blog's model")
    model.add_argument("--params", type=float, default=None,
                       help="a parameter count (7e9): a Qwen2.5-style shape of that size")
    plan.add_argument("--budget-usd", type=float, default=None, help="most the run may cost")
    plan.add_argument("--deadline-h", type=float, default=None,
                      help="longest the run may take, start-up included")
    plan.add_argument("--steps", type=int, default=500, help="optimizer steps (the blog's: 500)")
    plan.add_argument("--preset", choices=sorted(PRESET_FLAVORS), default=None,
                      help="a named run's model and flavors (`blog`: Qwen2.5-Math-1.5B, h200 "
                           "replicas, an h200x2 trainer); its own plan's forecast is printed too")
    plan.add_argument("--replica-flavor", default=None,
                      help="replica flavors to consider, comma separated (default: every "
                           "one-GPU flavor)")
    plan.add_argument("--trainer-flavor", default=None,
                      help="trainer flavors to consider, comma separated (default: all)")
    plan.add_argument("--replicas", default=None, help="replica counts to try (default 1,2,3,4)")
    plan.add_argument("--single-gpu", default=False, **BOOL_FLAG,
                      help="one GPU per job: one replica, a one-GPU trainer (the capstone's "
                           "size: a replica job and a trainer job, never one shared GPU)")
    plan.add_argument("--max-completion-tokens", type=int, default=3000,
                      help="longest completion (the blog's 3,000)")
    plan.add_argument("--prompts-per-step", type=_positive, default=None,
                      help="prompts per optimizer step (the blog's: 16)")
    plan.add_argument("--num-generations", type=_positive, default=None,
                      help="completions per prompt, G (the blog's: 8)")
    plan.add_argument("--weight-sync-steps", type=_positive, default=None,
                      help="steps between adapter publishes (the blog's: 4)")
    plan.add_argument("--mount-lag-s", type=_seconds, default=None,
                      help="the bucket mount's lag from a write in one job to its visibility in "
                           "another's, as `grpo-lab launch --preflight` measures it (default: "
                           "the blog's 2-4 s): the weight sync's load retries follow it")
    plan.add_argument("--refresh", default=False, **BOOL_FLAG,
                      help="prices from the Hub (HfApi.list_jobs_hardware); offline, the "
                           "committed table")
    plan.add_argument("--json", default=False, **BOOL_FLAG, help="print the forecast as JSON")
    plan.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`grpo-lab plan`: search, then print the recommendation (exit 2 with the reason if none)."""
    from ..launch.recipe_config import HF_BLOG_MODEL
    from ..launch.recipe_plan import preset_config
    from ..plan.flavors import PRICES_COPIED, PRICES_SOURCE, flavors
    from ..plan.planner import REPLICA_COUNTS, forecast_plan, plan_run

    table = flavors(refresh=args.refresh)
    replica_flavors, trainer_flavors = _names(args.replica_flavor), _names(args.trainer_flavor)
    if args.preset:
        replica_flavors = replica_flavors or [PRESET_FLAVORS[args.preset][0]]
        trainer_flavors = trainer_flavors or [PRESET_FLAVORS[args.preset][1]]
    counts = tuple(int(n) for n in _names(args.replicas)) if args.replicas else REPLICA_COUNTS
    if args.single_gpu:
        counts = (1,)
        trainer_flavors = trainer_flavors or [f.name for f in table.values() if f.gpus == 1]
    model = args.params if args.params is not None else (args.model or HF_BLOG_MODEL)
    recipe = {name: getattr(args, name) for name in RECIPE_FLAGS if getattr(args, name)}
    forecast = plan_run(model, steps=args.steps, budget_usd=args.budget_usd,
                        deadline_h=args.deadline_h, flavors_table=table,
                        replica_flavors=replica_flavors, trainer_flavors=trainer_flavors,
                        replica_counts=counts, max_completion_tokens=args.max_completion_tokens,
                        mount_lag_s=args.mount_lag_s, **recipe)
    own = None
    if args.preset:  # the preset's own plan, as `grpo-lab launch --preset NAME` submits it
        own = forecast_plan(preset_config(args.preset,
                                          max_completion_length=args.max_completion_tokens),
                            {"steps": args.steps, **recipe}, table, mount_lag_s=args.mount_lag_s)
    if args.json:
        out = {"recommendation": forecast.to_dict(), "prices": f"{PRICES_SOURCE}, {PRICES_COPIED}"}
        if own:
            out[f"preset_{args.preset}"] = own.to_dict()
        print(json.dumps(out, indent=2, default=str))
        return 0
    goal = ("cheapest within the deadline" if args.deadline_h is not None else
            "fastest within the budget" if args.budget_usd is not None else "cheapest")
    print(f"recommendation ({goal}; prices: {PRICES_SOURCE}, copied {PRICES_COPIED}"
          f"{', refreshed from the Hub where listed' if args.refresh else ''}):")
    print(forecast.describe())
    if own:
        print(f"\n`grpo-lab launch --preset {args.preset}` as it stands:")
        print(own.describe())
    return 0

"""Check the pipeline simulator against this machine's own runs: notebook 08's five knob runs
and the demo (`grpo-lab demo --jobs local`).

    OMP_NUM_THREADS=1 python benchmarks/simulator_vs_course.py   # ~3 minutes on 2 cores
    python benchmarks/simulator_vs_course.py --runs saved.json    # re-use saved runs

The five runs are run for real as notebook 08 runs them (two `grpo-lab serve` replicas and the
proxy started by LocalLauncher from `recipe_plan(...).only(...)`, notebook 08's parameters:
16 steps of 32 prompts x 4, the last 10 diagnosed, one sample per row, max_staleness 1;
grpo_lab_course.pipeline_runs.run_with_knobs). Before the servers start, a micro-benchmark
measures this machine once (`measure_machine`, the "machine prior", like the blog check's
datasheet): the trainer's own optimize() alone on one thread, one pass of 1 and of 128 samples
and 16 samples in 16 passes, which splits a pass into a fixed cost and a cost per token. The
stage costs are then calibrated from ONE run's records (`--calibrate`, default r2-token-budget:
one replica, one request in flight, one pass a step): its fwd+bwd scales both trainer parts by
one factor, its step and wait give a replica's time per request. Stated priors (COURSE_PRIORS):
a decode step does not grow with its batch (the tiny model's step is the server's per-step
overhead), and the trainer, the replicas and the proxy share the machine's cores
(StageCosts.cores: each busy single-thread process gets cores / busy of a core). The other four
runs are predicted with grpo_lab.plan.simulator (worker "batch": grpo_lab's admission rule) and
compared over notebook 08's window: step time, rollout wait, queue size and what both sides
have; goal within 20 %. Then the demo runs as a newcomer's `make demo` does (its own replicas,
proxy and trainer job: 16 prompts x 8, a row per group with its prompt once, a sync every step)
and is predicted from the same calibration, over its last WINDOW steps (`--no-demo` skips it).
Results go to benchmarks/results/simulator_vs_course.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from grpo_lab.plan.sim_model import PipelineSetting, StageCosts
from grpo_lab.plan.simulator import simulate

GOAL = 0.20
STEPS, WINDOW = 16, 10  # notebook 08's parameters cell: steps, window
ABS_TOL = {"rollout_wait_s": 0.05, "backpressure_s": 0.05, "version_wait_s": 0.05,
           "staleness_mean": 0.1}
"""Below these (seconds, versions) a difference counts as met: relative errors of near-zero
values mean nothing."""
RUNS = (("r1-start", 1, dict(token_budget=16, max_inflight=1)),
        ("r2-token-budget", 1, dict(token_budget=None, max_inflight=1)),
        ("r3-two-replicas", 2, dict(token_budget=None, max_inflight=1)),
        ("r4-lift-cap", 2, dict(token_budget=None, max_inflight=None)),
        ("r5-sync-interval", 2, dict(token_budget=None, max_inflight=None,
                                     weight_sync_steps=4)))
FIGURES = {"step_s": "perf/step_s", "fwd_bwd_s": "perf/fwd_bwd_s",
           "rollout_wait_s": "perf/rollout_wait_s", "queue": "sample/rollout_queue_size",
           "backpressure_s": "rollout/backpressure_total_s",
           "version_wait_s": "rollout/version_wait_s", "weight_sync_s": "perf/weight_sync_s",
           "staleness_mean": "sample/staleness_mean",
           "micro_batches": "batch/microbatches_per_step"}
COURSE_PRIORS = ("a pass's fixed and per-token costs in the machine micro-benchmark's ratio; a "
                 "decode step does not grow with its batch; busy single-thread processes "
                 "(trainer, decoding replicas, the proxy while requests fly) share the cores")


def measure_machine(samples=(1, 128), split=16, repeats=5, prompt_tokens=7,
                    completion_tokens=4) -> dict:
    """The trainer's pass on this machine, alone (before the servers start), 1 thread:
    grpo_lab's AsyncGRPOTrainer.optimize less its optimizer step (what a step's fwd_bwd_s
    times) on samples of the course's shape (prompt 7 + completion 4 tokens), median of
    `repeats`. One pass of n samples for n in `samples` gives the cost per forwarded token;
    `split` samples in one pass and in `split` passes give a pass's fixed cost; what is left
    of the 1-sample step is the step's own fixed cost (layout, sampler metrics). Then the
    `samples[1]` pass again beside one busy single-thread process (a Python loop): two busy
    processes each get cores / 2 of a core, so the slowdown gives the cores they share in
    effect: recorded, not used (the costs take os.cpu_count(); see the report's reasons)."""
    import dataclasses
    import subprocess
    import sys

    import torch

    from grpo_lab.data.completions import Completions
    from grpo_lab.train.async_config import AsyncGRPOConfig
    from grpo_lab.train.async_trainer import AsyncGRPOTrainer
    from grpo_lab.train.rollout_batch import RolloutBatch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = AsyncGRPOConfig(eval_every=0, progress=False, device="cpu")
    trainer = AsyncGRPOTrainer(config)
    tokens = prompt_tokens + completion_tokens

    def timed(n: int, budget: int | None) -> float:
        out = Completions([[5 + k % 7 for k in range(prompt_tokens)]] * n,
                          [[6 + k % 5 for k in range(completion_tokens)]] * n,
                          [[-1.0] * completion_tokens] * n, [""] * n, ["stop"] * n)
        advantages = torch.linspace(-1, 1, n) if n > 1 else torch.ones(1)
        batch = RolloutBatch.from_completions(out, torch.zeros(n), advantages,
                                              trainer.tokenizer.pad_token_id).to(trainer.device)
        trainer.config = dataclasses.replace(config, token_budget=budget)
        times = []
        for _ in range(repeats + 1):  # the first warms up
            start = time.perf_counter()
            metrics = trainer.optimize(batch)
            times.append(time.perf_counter() - start - metrics["perf/optimizer_s"])
        return statistics.median(times[1:])

    (n1, n2) = samples
    one = {n: timed(n, None) for n in (*samples, split)}
    passes = timed(split, tokens + 1)  # a budget of one sample: `split` passes
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        shared = timed(n2, None)
    finally:
        neighbour.kill()
        neighbour.wait(timeout=10)
    token_s = (one[n2] - one[n1]) / ((n2 - n1) * tokens)
    pass_s = (passes - one[split]) / (split - 1)
    return {"one_pass_s": {str(n): s for n, s in one.items()},
            f"{split}_passes_s": passes, "tokens_per_sample": tokens,
            "pass_fixed_s": pass_s, "pass_token_s": token_s,
            "step_fixed_s": one[n1] - pass_s - tokens * token_s,
            f"one_pass_{n2}_beside_a_busy_process_s": shared,
            "cores_effective": min(os.cpu_count() or 1, 2 * one[n2] / shared),
            "repeats": repeats, "threads": 1,
            "what": "AsyncGRPOTrainer.optimize less its optimizer step, median of "
                    f"{repeats}, alone before the servers start"}

NOTES = [
    "r1: one scale for a pass's fixed and per-token parts does not hold: in the live runs a "
    "1-sample pass ran ~1.4x its micro-benchmark time, r2's 128-sample pass 2.6-3.4x, so "
    "r2's scale overshoots r1 (+110 to +140 %); its version wait follows its step",
    "demo: predicted from r2 (other settings: 16 x 8, a row per group, two replicas); its "
    "version wait, tens of milliseconds, is overstated from r2's replica time per request "
    "(one request in flight there, a whole step's in the demo)",
    "run-to-run noise on this shared 2-core machine exceeds the 20 % goal for fwd+bwd: r2's "
    "pass measured 0.263 s in one invocation and 0.375 s in the next, r3's 0.375 then 0.293 "
    "(below r2's, with more processes); r4's 0.384 then 0.261",
    "two busy processes slow each other ~2.3x here (machine_prior.cores_effective ~0.85-0.9), "
    "yet cores = os.cpu_count() predicts r3-r5 better than the effective count; threads inside "
    "the trainer (its rollout worker) are not counted",
]
"""Why the misses miss (benchmarks/results/simulator_vs_course.json's `notes`)."""


def run_for_real() -> dict:
    """Notebook 08's five runs on this machine: {name: {knobs, records, seconds}}."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from grpo_lab.launch.local import LocalLauncher
    from grpo_lab.launch.recipe_plan import recipe_plan
    from grpo_lab_course.pipeline_runs import run_with_knobs

    work = Path(tempfile.mkdtemp(prefix="grpo-lab-sim-course-"))
    plan = recipe_plan(backend="local", replicas=2, max_staleness=1, bucket=str(work / "bucket"),
                       run_name="knobs", health_timeout_s=180).only("replica-0", "replica-1",
                                                                    "proxy")
    jobs = LocalLauncher(plan, work).start()
    urls = {1: f"http://127.0.0.1:{plan['replica-0'].ports[0]}",
            2: f"http://127.0.0.1:{plan['proxy'].ports[0]}"}
    out = {}
    try:
        for name, replicas, knobs in RUNS:
            run = run_with_knobs(name, urls[replicas], work / "bucket", steps=STEPS, window=WINDOW,
                                 replicas=replicas, shared_prompt=False, prompts_per_step=32,
                                 num_generations=4, progress=False, **knobs)
            out[name] = dict(knobs=run.knobs, records=run.records, seconds=run.seconds)
            print(f"{name}: {run.seconds:.1f} s, {run.diagnosis.bottleneck}", flush=True)
    finally:
        jobs.stop()
    return out


def run_demo() -> dict:
    """`grpo-lab demo --jobs local` as `make demo` runs it: its trainer's records and settings."""
    from grpo_lab.cli.main import main as grpo_lab_main
    from grpo_lab.cli.multi_job import RUN_NAME

    run_dir = Path(tempfile.mkdtemp(prefix="grpo-lab-sim-demo-")) / "demo"
    start = time.perf_counter()
    if grpo_lab_main(["demo", "--output-dir", str(run_dir), "--progress", "false"]) != 0:
        raise RuntimeError(f"the demo failed: {run_dir}")
    trainer = run_dir / "bucket" / RUN_NAME
    records = [json.loads(line) for line in (trainer / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((trainer / "config.json").read_text())
    knobs = {"replicas": 2, "max_inflight": None, "request_shape": "group",  # the demo's
             **{k: config[k] for k in ("token_budget", "weight_sync_steps", "max_staleness",
                                       "prompts_per_step", "num_generations", "shared_prompt",
                                       "buffer_size")}}
    return dict(knobs=knobs, records=[r for r in records if r.get("step", 0) > 0],
                seconds=time.perf_counter() - start)


def window_means(records: list[dict]) -> dict:
    rows = records[-WINDOW:]
    return {name: statistics.fmean(r.get(key, 0.0) for r in rows)
            for name, key in FIGURES.items()}


def course_setting(run: dict) -> PipelineSetting:
    """A measured run's settings and sample lengths as a PipelineSetting."""
    knobs, records = run["knobs"], run["records"]
    completion = statistics.fmean(r["completions/mean_length"] for r in records)
    sample = statistics.fmean(r["sample/forwarded_tokens_mean"] for r in records)
    prompts = knobs.get("prompts_per_step", 32)  # notebook 08's runs: 32 x 4, a row a sample
    return PipelineSetting(
        replicas=knobs["replicas"], max_inflight=knobs["max_inflight"], prompts_per_step=prompts,
        num_generations=knobs.get("num_generations", 4), max_staleness=knobs["max_staleness"],
        buffer_size=knobs.get("buffer_size") or prompts,
        shared_prompt=knobs.get("shared_prompt", False),
        token_budget=knobs["token_budget"], micro_batch_size=128, packing=False,
        gradient_checkpointing=False, weight_sync_steps=knobs["weight_sync_steps"],
        steps=len(records), prompt_tokens=round(sample - completion),
        max_completion_tokens=max(r["completions/max_length"] for r in records),
        completion_tokens=completion, completion_sigma=0.1, prompt_sigma=1e-3,
        max_prompt_tokens=max(r["sample/forwarded_tokens_max"] for r in records),
        request_shape=knobs["request_shape"], worker="batch")


def course_costs(run: dict, machine: dict) -> StageCosts:
    """CPU stage costs of the tiny model from one run's records (its diagnosed window) and the
    machine prior (`measure_machine`): the run's fwd+bwd scales the prior's pass, fixed part
    and per-token part alike, then again by measured / simulated until the calibration run's
    own core sharing (none for r2: a trainer and one replica on 2 cores) is taken out."""
    rows = run["records"][-WINDOW:]
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in rows)  # noqa: E731
    setting = course_setting(run)
    passes = mean("batch/microbatches_per_step")
    alone = (passes * machine["pass_fixed_s"]
             + mean("batch/forwarded_tokens_per_step") * machine["pass_token_s"])
    scale = mean("perf/fwd_bwd_s") / alone
    outside = (mean("perf/step_s") - mean("perf/fwd_bwd_s") - mean("perf/rollout_wait_s")
               - mean("perf/weight_sync_s"))
    # a batch is P / cap rounds of requests, each `completion` decode steps long: a
    # generation-bound run's step (less its sync, the replicas' pause) is that many steps;
    # otherwise the worker's busy tokens/s over the sequences a replica decodes at once
    inflight = min(setting.max_inflight or setting.prompts_per_step, setting.prompts_per_step)
    if mean("perf/rollout_wait_s") > 0.05 * mean("perf/step_s"):
        rounds = setting.prompts_per_step / inflight * setting.completion_tokens
        step_s = (mean("perf/step_s") - mean("perf/weight_sync_s")) / rounds
    else:
        per_replica = setting.num_generations * inflight / setting.replicas
        step_s = per_replica / max(mean("rollout/generated_tok_s_busy") / setting.replicas,
                                   1e-9)
    sync = mean("perf/weight_sync_s") * setting.weight_sync_steps
    costs = StageCosts(decode_step_s=step_s, decode_seq_s=0.0, decode_ctx_s=0.0,
                      prefill_token_s=0.0, prefix_tail_tokens=0,
                      train_token_s=scale * machine["pass_token_s"],
                      train_micro_batch_s=scale * machine["pass_fixed_s"],
                      step_micro_batch_s=0.0, optimizer_s=max(outside, 0.0) / max(passes, 1)
                      if passes == 1 else max(outside, 0.0),
                      checkpointing_factor=1.0, sync_pause_s=0.0, sync_save_s=sync,
                      sync_load_s=0.0, sync_other_s=0.0, mount_lag_s=(0.0, 0.0),
                      load_retry_s=1.0, trainer_gpus=1, cores=os.cpu_count(),
                      source=f"{run['name']}'s records on this machine; priors: {COURSE_PRIORS}")
    generation_bound = mean("perf/rollout_wait_s") > 0.05 * mean("perf/step_s")
    for _ in range(4):  # the calibration run's own core sharing out of its costs
        simulated = window_means(simulate(setting, costs))
        ratio = mean("perf/fwd_bwd_s") / simulated["fwd_bwd_s"]
        decode = mean("perf/step_s") / simulated["step_s"] if generation_bound else 1.0
        costs = replace(costs, train_token_s=costs.train_token_s * ratio,
                        train_micro_batch_s=costs.train_micro_batch_s * ratio,
                        decode_step_s=costs.decode_step_s * decode)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", help="JSON of saved runs (this script's `measured`) to reuse")
    parser.add_argument("--calibrate", default="r2-token-budget")
    parser.add_argument("--no-demo", action="store_true", help="notebook 08's runs only")
    parser.add_argument("--machine", help="a results JSON whose machine_prior to reuse")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"
                                             / "simulator_vs_course.json"))
    args = parser.parse_args()
    start = time.perf_counter()
    machine = (json.loads(Path(args.machine).read_text())["machine_prior"] if args.machine
               else measure_machine())  # before the servers start: the trainer alone
    print(f"machine prior: a pass {machine['pass_fixed_s'] * 1e3:.1f} ms + "
          f"{machine['pass_token_s'] * 1e6:.1f} us a token", flush=True)
    measured = json.loads(Path(args.runs).read_text()) if args.runs else run_for_real()
    if not args.no_demo and "demo" not in measured:
        measured["demo"] = run_demo()
        print(f"demo: {measured['demo']['seconds']:.1f} s", flush=True)
    for name, run in measured.items():
        run["name"] = name
    costs = course_costs(measured[args.calibrate], machine)
    runs, table = {}, []
    for name, run in measured.items():
        setting = course_setting(run)
        predicted = window_means(simulate(setting, costs, seed=0))
        actual = window_means(run["records"])
        rows = []
        for figure in FIGURES:
            p, a = predicted[figure], actual[figure]
            error = (p - a) / a if a else None
            ok = (error is not None and abs(error) <= GOAL) or abs(p - a) <= ABS_TOL.get(
                figure, 0.0)
            rows.append(dict(figure=figure, measured=a, predicted=p, rel_error=error,
                             within_goal=ok))
            table.append((name, rows[-1]))
        runs[name] = dict(role="calibration" if name == args.calibrate else "prediction",
                          knobs=run["knobs"], figures=rows)
    predictions = [r for name, r in table if name != args.calibrate]
    key = [r for r in predictions if r["figure"] in ("step_s", "rollout_wait_s", "queue")]
    summary = {"goal_rel_error": GOAL, "calibrated_on": args.calibrate,
               "figures_predicted": len(predictions),
               "within_goal": sum(r["within_goal"] for r in predictions),
               "key_figures_within_goal": f"{sum(r['within_goal'] for r in key)} of {len(key)}",
               "misses": [f"{name} {r['figure']}" for name, r in table
                          if name != args.calibrate and not r["within_goal"]]}
    results = {"summary": summary, "priors": COURSE_PRIORS, "notes": NOTES,
               "machine_prior": machine,
               "steps": STEPS, "window": WINDOW, "costs": costs.__dict__,
               "runs": runs, "measured": measured,
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                           "load_average": os.getloadavg(),
                           "seconds": time.perf_counter() - start}}
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print(f"{'run':<17} {'figure':<15} {'measured':>9} {'predicted':>9} {'error':>7}")
    for name, r in table:
        err = "" if r["rel_error"] is None else f"{r['rel_error']:+.0%}"
        mark = "" if r["within_goal"] else ("  (calibration)" if name == args.calibrate
                                            else "  MISS")
        print(f"{name:<17} {r['figure']:<15} {r['measured']:>9.3f} {r['predicted']:>9.3f} "
              f"{err:>7}{mark}")
    print(f"{summary['within_goal']} of {summary['figures_predicted']} predicted figures within "
          f"{GOAL:.0%} (step, wait, queue: {summary['key_figures_within_goal']}) -> {args.out}")


if __name__ == "__main__":
    main()

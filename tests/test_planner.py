"""`grpo-lab plan` and the planner behind it (grpo_lab.plan.planner): flavors, replicas and
settings chosen through the pipeline simulator, the memory check, the HF Jobs flavor table."""

import json

import pytest
from huggingface_hub._jobs_api import JobHardwareInfo

from grpo_lab.cli.main import main
from grpo_lab.launch.recipe_plan import preset_config
from grpo_lab.model.memory_model import GiB, StepSetting, num_parameters, step_memory
from grpo_lab.model.shaped_models import QWEN25_MATH_15B
from grpo_lab.plan.flavors import EXPOSED_PORT_USD_PER_H, FLAVORS, flavors
from grpo_lab.plan.planner import STARTUP_S, forecast_plan, plan_run
from grpo_lab.plan.run_forecast import model_shape, trainer_gib
from grpo_lab.plan.sim_blog import blog_setting

SMALL = ["t4-small", "l4x1", "a10g-small", "l40sx1", "a100-large", "h200"]
"""One-GPU flavors: the capstone's single-GPU plan takes its trainer from these."""


def test_blog_plan_prints_a_recommendation_a_wall_clock_and_a_cost(capsys):
    """The blog's setting (Qwen2.5-Math-1.5B, h200 replicas, an h200x2 trainer): the planner
    picks replicas, cap, token budget and staleness; its bill is every job's price x the wall
    clock; the preset's own plan is forecast beside it."""
    assert main(["plan", "--preset", "blog"]) == 0
    out = capsys.readouterr().out
    assert "recommendation" in out and "trainer h200x2" in out and "x h200 " in out
    for word in ("step time", "wall clock", "cost", "bottleneck", "memory check",
                 "`grpo-lab launch --preset blog` as it stands"):
        assert word in out, word
    best = plan_run("qwen2.5-math-1.5b", replica_flavors=["h200"], trainer_flavors=["h200x2"])
    hourly = best.replicas * (FLAVORS["h200"].hourly_usd + EXPOSED_PORT_USD_PER_H) + 10.0
    assert best.hourly_usd == pytest.approx(hourly)
    assert best.cost_usd == pytest.approx(hourly * best.wall_clock_s / 3600)
    assert best.wall_clock_s > STARTUP_S + best.setting.steps * best.step_s * 0.5
    assert best.setting.token_budget == 16384 and not best.setting.gradient_checkpointing
    assert best.trainer_memory_gib <= best.trainer_limit_gib
    assert best.replica_memory_gib <= best.replica_limit_gib


def test_capstone_model_on_one_gpu_per_job(capsys):
    """Qwen2.5-0.5B with --single-gpu: one replica job and one trainer job, one GPU each (the
    recipe always runs them as separate jobs; they never share a GPU on HF Jobs)."""
    assert main(["plan", "--model", "qwen2.5-0.5b", "--single-gpu", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["recommendation"]
    assert plan["replicas"] == 1 and FLAVORS[plan["trainer_flavor"]].gpus == 1
    assert FLAVORS[plan["replica_flavor"]].gpus == 1
    assert plan["wall_clock_s"] > STARTUP_S and plan["cost_usd"] > 0
    assert FLAVORS[plan["trainer_flavor"]].spec.bf16  # never a T4 (fp16 only) as the trainer


def test_a_tighter_budget_never_gives_a_dearer_plan():
    plans = {}
    for budget in (1000, 60, 30, 20, 12):
        try:
            plans[budget] = plan_run("qwen2.5-math-1.5b", budget_usd=budget,
                                     replica_flavors=["l40sx1", "a100-large", "h200"],
                                     trainer_flavors=["a100-large", "h200", "h200x2"])
        except ValueError as exc:
            assert "raise --budget-usd" in str(exc)
    costs = [plans[b].cost_usd for b in sorted(plans, reverse=True)]
    assert len(costs) >= 3 and costs == sorted(costs, reverse=True), costs
    assert all(plans[b].cost_usd <= b for b in plans)
    fastest = plans[1000].wall_clock_s
    assert all(p.wall_clock_s >= fastest for p in plans.values())


def test_a_deadline_that_cannot_be_met_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match=r"no plan meets the deadline of 0.05 h.*--deadline-h"):
        plan_run("qwen2.5-math-1.5b", deadline_h=0.05, replica_flavors=["h200"],
                 trainer_flavors=["h200x2"])
    assert main(["plan", "--preset", "blog", "--deadline-h", "0.05"]) == 2
    assert "no plan meets the deadline" in capsys.readouterr().err


def test_a_model_too_big_for_every_flavor_is_rejected_for_memory():
    with pytest.raises(ValueError, match=r"no trainer flavor holds .* even h200x8 needs [\d.]+ "
                                         r"GiB per GPU"):
        plan_run(2e12)
    # enough trainer memory, but no replica GPU holds the weights
    with pytest.raises(ValueError, match=r"no replica flavor holds .*GiB > "):
        plan_run(100e9, trainer_flavors=["h200x8"])


def test_memory_check_is_the_real_shapes_model():
    """On one GPU the trainer's memory is grpo_lab.model.memory_model's step at the blog's
    recipe (benchmarks/real_shapes.py's BLOG: 128 rows, 16,384-token micro-batches, the LM head
    in 110-position chunks); the largest token budget that fits an H200 with the planner's
    margin is the blog's own 16,384."""
    blog = StepSetting(prompts=16, num_generations=8, prompt_tokens=1096, completion_tokens=3000,
                       dtype="bfloat16", lora_rank=1, micro_batch_rows=4, logits_chunk_rows=110,
                       generate_in_process=False)
    assert model_shape("Qwen/Qwen2.5-Math-1.5B") is QWEN25_MATH_15B
    one_gpu = trainer_gib(QWEN25_MATH_15B, 1, 16384, False, (1096, 3000))
    assert one_gpu == pytest.approx(step_memory(QWEN25_MATH_15B, blog).total / GiB, rel=1e-9)
    assert 60 < one_gpu < 70  # 66.24 GiB in benchmarks/results/real_shapes.json
    two_gpus = trainer_gib(QWEN25_MATH_15B, 2, 16384, False, (1096, 3000))
    assert one_gpu - two_gpus == pytest.approx(num_parameters(QWEN25_MATH_15B) * 2 / 2 / GiB,
                                               rel=0.01)  # FSDP2 halves the weights
    assert num_parameters(model_shape(7e9)) == pytest.approx(7e9, rel=0.15)


def test_launch_dry_run_shows_the_planners_forecast_of_that_plan(capsys):
    assert main(["launch", "--backend", "hf-jobs", "--preset", "blog", "--dry-run",
                 "--run-name", "blog"]) == 0
    out = capsys.readouterr().out
    forecast = [line for line in out.splitlines() if line.startswith("# ")]
    text = "\n".join(forecast)
    assert "forecast" in text and "2 x h200" in text and "trainer h200x2" in text
    assert "max_inflight 128" in text and "token_budget 16,384" in text and "$" in text
    own = forecast_plan(preset_config("blog"))
    assert own.setting == blog_setting(3)  # the preset is the blog's run 3, simulated as such
    assert f"${own.cost_usd:,.2f}" in text


def test_flavors_from_the_hub_or_the_committed_table_offline():
    """`flavors(refresh=True)` reads HfApi.list_jobs_hardware (faked here: this machine has no
    Hub access); offline it falls back to the committed table."""
    def info(name, model, quantity, vram, per_minute):
        return JobHardwareInfo(name=name, prettyName=name, cpu="23 vCPU", ram="256 GB",
                               accelerator={"type": "gpu", "model": model, "quantity": quantity,
                                            "vram": vram, "manufacturer": "Nvidia"},
                               unitCostMicroUSD=int(per_minute * 1e6), unitCostUSD=per_minute,
                               unitLabel="minute")

    class Hub:
        def list_jobs_hardware(self):
            return [info("h200", "H200", "1", "141 GB", 0.1), info("h200x2", "H200", "2",
                                                                   "282 GB", 0.2),
                    info("mystery-gpu", "Z9", "1", "8 GB", 0.01),
                    JobHardwareInfo(name="cpu-basic", prettyName="CPU Basic", cpu="2 vCPU",
                                    ram="16 GB", unitCostMicroUSD=167, unitCostUSD=0.000167,
                                    unitLabel="minute")]

    class Offline:
        def list_jobs_hardware(self):
            raise OSError("no network")

    live = flavors(refresh=True, api=Hub())
    assert live["h200"].hourly_usd == pytest.approx(6.0) and live["h200"].source == "hub"
    assert live["h200x2"].gpu_memory_gib == pytest.approx(FLAVORS["h200x2"].gpu_memory_gib)
    assert "mystery-gpu" not in live and "cpu-basic" not in live  # no speed to plan with
    assert live["a100-large"] == FLAVORS["a100-large"]  # not listed: the table's
    assert flavors(refresh=True, api=Offline()) == FLAVORS
    assert flavors() == FLAVORS
    cheaper = plan_run("qwen2.5-math-1.5b", flavors_table=live, replica_flavors=["h200"],
                       trainer_flavors=["h200x2"], steps=50)
    assert cheaper.hourly_usd == pytest.approx(cheaper.replicas * 6.01 + 12.0)


def test_a_measured_mount_lag_sets_the_weight_sync_and_the_bill(capsys):
    """A preflight's mount lag replaces the blog's 2-4 s: a slower mount means more load
    retries per sync, so a longer sync, wall clock and bill for the same plan."""
    config = preset_config("blog")
    blog, fast, slow = (forecast_plan(config, mount_lag_s=lag) for lag in (None, 0.0, 30.0))
    syncs = [f.summary["weight_sync_s_p50"] for f in (fast, blog, slow)]
    assert syncs == sorted(syncs) and syncs[2] > syncs[0] + 20  # about one retry per 2 s
    assert slow.wall_clock_s > blog.wall_clock_s and slow.cost_usd > blog.cost_usd
    assert "mount lag 30.00 s (measured by a preflight)" in slow.describe()
    assert "mount lag 2-4 s (the blog's)" in blog.describe()
    assert main(["plan", "--preset", "blog", "--mount-lag-s", "30"]) == 0
    assert "mount lag 30.00 s (measured by a preflight)" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a negative lag is refused by the parser
        main(["plan", "--preset", "blog", "--mount-lag-s", "-1"])


def test_the_recipe_settings_reach_the_simulated_plan(capsys):
    """`--prompts-per-step`, `--num-generations`, `--weight-sync-steps`: the simulated setting
    takes them, and twice the samples per step make a slower step; bad values are refused."""
    assert main(["plan", "--preset", "blog", "--replicas", "2", "--json"]) == 0
    base = json.loads(capsys.readouterr().out)["preset_blog"]
    assert main(["plan", "--preset", "blog", "--replicas", "2", "--json", "--prompts-per-step",
                 "32", "--weight-sync-steps", "8", "--num-generations", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    for plan in (out["recommendation"], out["preset_blog"]):
        setting = plan["setting"]
        assert (setting["prompts_per_step"], setting["num_generations"],
                setting["weight_sync_steps"]) == (32, 4, 8)
    assert main(["plan", "--preset", "blog", "--replicas", "2", "--json",
                 "--prompts-per-step", "32"]) == 0
    bigger = json.loads(capsys.readouterr().out)["preset_blog"]
    assert bigger["step_s"] > base["step_s"] * 1.3  # 256 samples a step against 128
    with pytest.raises(SystemExit):
        main(["plan", "--prompts-per-step", "0"])


def test_the_budget_and_deadline_compare_the_figures_printed(capsys):
    """The planner ranks plans on short estimates, then simulates the best over every step: the
    plan it picks meets the budget on the cost it prints, and a refusal quotes a cost that is
    itself enough. The reviewer's case: 7B over 500 steps, `--budget-usd 88`, was refused as
    "cheapest costs $90.30" beside a plan printed at $84.22."""
    assert main(["plan", "--params", "7e9", "--steps", "500", "--budget-usd", "88",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["recommendation"]
    assert plan["cost_usd"] <= 88
    with pytest.raises(ValueError, match=r"costs \$[\d,.]+; raise --budget-usd to") as refused:
        plan_run(7e9, steps=500, budget_usd=10)
    quoted = float(str(refused.value).split("costs $")[1].split(";")[0].replace(",", ""))
    cheapest = plan_run(7e9, steps=500, budget_usd=quoted + 0.01)
    assert cheapest.cost_usd <= quoted + 0.01
    assert plan_run(7e9, steps=500, deadline_h=2).wall_clock_s <= 2 * 3600


def test_every_forecast_carries_the_simulators_measured_band(capsys):
    """FORECAST_BAND is the simulator's largest error on the step times and wall clocks of the
    blog's runs it was not calibrated on, read from its benchmark's results; every forecast
    prints its wall clock and cost with that band, and --json carries it."""
    from pathlib import Path

    from grpo_lab.plan.run_forecast import FORECAST_BAND

    results = json.loads((Path(__file__).parents[1] / "benchmarks" / "results"
                          / "simulator_vs_blog.json").read_text())
    errors = [abs(f["rel_error"]) for run in results["runs"].values()
              if run["role"] == "prediction" for f in run["figures"]
              if f["figure"] in ("step_s_p50", "wall_clock_s")]
    assert errors and FORECAST_BAND == pytest.approx(max(errors), abs=0.005)
    forecast = forecast_plan(preset_config("blog"))
    text = forecast.describe()
    low, high = 1 - FORECAST_BAND, 1 + FORECAST_BAND
    assert f"likely ${low * forecast.cost_usd:,.2f} to ${high * forecast.cost_usd:,.2f}" in text
    assert "+/-16%" in text
    assert main(["plan", "--preset", "blog", "--json"]) == 0
    band = json.loads(capsys.readouterr().out)["recommendation"]["band"]
    lo, hi = band["cost_usd"]
    assert lo < hi and band["share"] == FORECAST_BAND

"""The run doctor: read a run's metrics as they arrive and name what is silently wrong.

Each record is one step's metrics under TRL's names (`metrics.jsonl`, or TRL's own logs).
`Doctor.observe(record)` returns the findings that record makes true for the first time: each
finding is reported once, with its evidence (the metric, the window of steps, the value and the
threshold), the likely cause, the fix, and what a healthy run of the course logs there.

The thresholds come from the course's own runs: healthy ones (the demo, notebooks 01, 04, 07)
and ones broken on purpose (notebook 10, the tests in tests/test_doctor.py); the values each
run logged are in benchmarks/results/doctor_thresholds.json.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from statistics import median
from typing import NamedTuple

CLIPPED, ZERO_STD = "completions/clipped_ratio", "frac_reward_zero_std"
ENTROPY, REWARD, KL, CLIP = "entropy", "reward", "kl", "clip_ratio/region_mean"
DROPPED, STALE_MEAN = "sample/dropped_stale_total", "sample/staleness_mean"

# What a finding needs before it can speak, and where it speaks up. Healthy course runs sit far
# from every bound (benchmarks/results/doctor_thresholds.json has each run's values).
WINDOW = 10
"""Steps a finding is judged over (the last WINDOW records that carry its metric)."""
CLIPPED_SHARE = 0.5
"""Completions cut at max_completion_length: healthy course runs 0-0.1; a cap of 8 tokens, 1.0."""
ZERO_STD_SHARE = 0.8
"""Groups with one reward for all G: healthy 0.1-0.4; notebook 10's high learning rate 0.85-1."""
ENTROPY_START, ENTROPY_NOW = 2, 5
ENTROPY_COLLAPSE, ENTROPY_EXPLODE = 0.2, 2.0
"""Entropy of the last 5 steps against the first 2: below 0.2x has collapsed, above 2x has
exploded. Healthy tiny-model runs end 150 steps at 0.78x (full) and 0.86x (LoRA) of their start;
a learning rate of 1e-2 (full) reaches 2.8x by step 12, 3e-3 2.2x. The move must also exceed
ENTROPY_MIN_MOVE nats: a near-greedy sampler's entropy (~0.001 nats) doubles in noise alone."""
ENTROPY_MIN_MOVE = 0.1
CONVERGED_REWARD, CONVERGED_WINDOWS = 0.05, (5, 10)
"""A collapse while the reward rose by at least this much (the mean of the last 5 steps, or of
the last 10, against the first 5: a sampled reward of 8 prompts a step swings by 0.1-0.2 from one
step to the next, so one short window alone dips under the bar in a healthy run) is the policy
converging on what the reward asks, not a failure. SmolLM2-135M on
`sum_form` (one right reply per question) falls from 0.3-0.5 nats to 0.03-0.05 while its
reward rises by 0.16-0.47 and its held-out accuracy by 19-32 points (notebook 09b,
benchmarks/results/real_model_gain.json); at twice the learning rate it collapses as far while
its reward falls (0.58 -> 0.54)."""
FLAT_STEPS, FLAT_REWARD = 80, 0.03
"""Reward flat: after FLAT_STEPS steps, the last window's mean reward is within 0.03 of the first
window's (nothing learned), while gradients flow (grad_norm > 0) and the reward is neither 0
nor 1 everywhere. A reward that rose and then plateaus is not flat: it learned. Healthy LoRA on
the tiny model is still flat at step 40 (it rises after), +0.1 or more by step 80 in the demo's
setting; at notebook 04's (16 prompts a step, one thread) the sampled reward rose only 0.05-0.09 in
150 steps, and at one seed a 10-step window sat within 0.03 of the start while greedy accuracy
rose 0.29 -> 0.49. So a run whose held-out accuracy has risen by FLAT_ACCURACY since its first
evaluation is learning, whatever its sampled reward's windows say."""
FLAT_ACCURACY = 0.05
LOW_ENTROPY, LOW_TEMPERATURE = 0.05, 0.3
"""Named as the cause of groups without spread: an entropy under 0.05 nats per token in the
run's first steps, or a sampling temperature under 0.3. SmolLM2-135M at temperature 0.1 ends at
0.001 nats per token with most groups without spread (benchmarks/results/real_model_gain.json);
healthy tiny-model runs sample 0.38-0.64 nats (doctor_thresholds.json), SmolLM2's start at
0.3-0.5 and converge to 0.03-0.05 (when a converged run's groups lose their spread, the first
steps still show it)."""
MOVE_REACH = 1e-4
"""Policy not moving (LoRA runs): the learning rate times the steps so far under 1e-4 (Adam moves
a weight by about the learning rate a step, so no weight can have moved further) while the reward
has not risen by FLAT_REWARD. It can only speak early: the reach grows with every step, and from
a learning rate of 1e-5 on it never speaks. The course's runs reach 5e-3 to 1e-2 by step 10; SmolLM2
at 1e-6 gained 0.4 points in 30 steps (reward 0.29 -> 0.30;
benchmarks/results/real_model_gain.json), where reward_flat, which waits FLAT_STEPS, said
nothing."""
SMALL_LEARNING_RATE = 1e-6
"""Named as the cause of a flat reward: below TRL's default for full fine-tuning of billions of
parameters, LoRA on the course's models moves nothing in a run's length."""
SAMPLER_KL = {"none": 1e-2, "corrected": 3e-2}
"""kl of sampler against trainer (the async trainer's `kl`, a window's median) beyond what the
objective handles. Healthy course runs: ~1e-4 at staleness 1 (notebooks 04, 07), 2e-4 from a
bf16 sampler, up to 2.2e-3 in the demo's first steps at learning rate 2e-3; a TIS or MIS
correction is run at staleness 8 (~2.5e-3, notebook 05b). Beyond these the samples come from
another policy."""
NOT_FROM_POLICY_GROWTH, NOT_FROM_POLICY_KL = 2.0, 2e-3
"""The sampler's kl still growing while the trainer publishes versions: the last window's median
at least twice the median of the window two windows before and of the run's first, and above
2e-3, the healthy runs' highest. The replicas stay where they were while the trainer moves away:
a replica that never updates (tests/test_doctor.py) goes from ~2.5e-3 to ~6e-3 within 30 steps;
a healthy run's kl stays level or falls as its learning rate decays."""
CLIP_SHARE = 0.2
"""Tokens clipped at any step of a window: healthy runs at one update per batch clip none
(synchronous) or 0-0.02 (asynchronous, against a sampler one version old); a learning rate of
1e-3 (full fine-tuning, 2 updates per batch) clips 31 % at its first step."""


@dataclass
class Finding:
    """One named problem, with its evidence, cause and fix."""

    code: str
    title: str
    step: int
    evidence: dict
    cause: str
    fix: str
    normal: str
    kind: str = "problem"
    """`problem` (the run is silently broken), or `note`: where the time goes, no fault (the
    pipeline's bottleneck)."""

    def text(self) -> str:
        shown = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in self.evidence.items())
        tag = "[doctor]" if self.kind == "problem" else "[doctor, note]"
        return (f"{tag} step {self.step}: {self.title}\n  evidence: {shown}\n"
                f"  normal: {self.normal}\n  likely cause: {self.cause}\n  fix: {self.fix}")

    def as_dict(self) -> dict:
        return asdict(self)


def _values(records: list[dict], key: str, last: int | None = WINDOW) -> list[float]:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return values[-last:] if last else values


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class Doctor:
    """Watches one run. `correction`: the sampler correction in use (`none`, or `tis`/`mis`/
    `decoupled`: `corrected`); `max_staleness`: the async trainer's bound (None: synchronous);
    `temperature`, `learning_rate`: the run's, when known, so that a cause can name them (the
    learning rate is given for LoRA runs only: `make_doctor`)."""

    def __init__(self, correction: str = "none", max_staleness: int | None = None,
                 window: int = WINDOW, checks: tuple | None = None,
                 temperature: float | None = None, learning_rate: float | None = None):
        self.correction = "none" if correction in (None, "none", "") else "corrected"
        self.max_staleness = max_staleness
        self.temperature, self.learning_rate = temperature, learning_rate  # named in causes
        self.window = window
        self.checks = CHECKS if checks is None else checks
        self.records: list[dict] = []
        self.accuracies: list[float] = []  # held-out accuracy at each evaluation, in order
        self.findings: dict[str, Finding] = {}

    def observe(self, record: dict) -> list[Finding]:
        """Take one step's record; return the findings it raises for the first time."""
        if isinstance(record.get("eval/accuracy"), (int, float)):
            self.accuracies.append(record["eval/accuracy"])
        if "step" not in record or "eval/accuracy" in record and len(record) <= 3:
            return []  # an evaluation-only record carries no training metrics
        self.records.append(record)
        new = []
        for check in self.checks:
            finding = check(self)
            if finding is not None and finding.code not in self.findings:
                self.findings[finding.code] = finding
                new.append(finding)
        return new

    def read(self, records: Iterable[dict]) -> list[Finding]:
        """A whole (finished or running) run's records; every finding in the order raised."""
        for record in records:
            self.observe(record)
        return list(self.findings.values())

    def finding(self, code: str, title: str, evidence: dict, cause: str, fix: str,
                normal: str, kind: str = "problem") -> Finding:
        return Finding(code, title, int(self.records[-1].get("step", len(self.records))),
                       evidence, cause, fix, normal, kind)


def completions_cut(d: Doctor) -> Finding | None:
    share = _values(d.records, CLIPPED, d.window)
    if len(share) < d.window or _mean(share) < CLIPPED_SHARE:
        return None
    return d.finding(
        "completions_cut", "completions are cut at the length cap",
        {"metric": CLIPPED, "window": len(share), "value": _mean(share),
         "threshold": CLIPPED_SHARE},
        "max_completion_length is too small for the answers, or the model no longer ends them "
        "(no EOS: a prompt that skipped the chat template, or a learning rate that broke the "
        "policy)",
        "raise max_completion_length; check the prompts are templated",
        "healthy course runs cut 0-10 % of completions")


def no_learning_signal(d: Doctor) -> Finding | None:
    share = _values(d.records, ZERO_STD, d.window)
    if len(share) < d.window or _mean(share) < ZERO_STD_SHARE:
        return None
    evidence = {"metric": ZERO_STD, "window": len(share), "value": _mean(share),
                "threshold": ZERO_STD_SHARE}
    # The specific causes are read from the whole run: a converged policy has no spread either,
    # but had it at the start.
    rewards, stds = _values(d.records, REWARD, None), _values(d.records, "reward_std", None)
    entropy = _values(d.records, ENTROPY, None)[:ENTROPY_START]
    if stds and max(stds) == 0 and max(rewards) == min(rewards):
        evidence["reward"] = rewards[-1]
        cause = (f"every completion gets the same reward ({rewards[-1]:g}), step after step: the "
                 "reward is constant (does it read the completions?)")
        fix = "check the reward function on a right and a wrong completion; partial credit"
    elif entropy and _mean(entropy) < LOW_ENTROPY or (d.temperature or 1) < LOW_TEMPERATURE:
        evidence.update(entropy=_mean(entropy) if entropy else None, temperature=d.temperature)
        cause = ("the G samples of a prompt are nearly the same: "
                 + (f"entropy {_mean(entropy):.3g} nats per token from the start" if entropy
                    else "")
                 + (f" at temperature {d.temperature:g}" if d.temperature is not None else "")
                 + " (a temperature near zero samples the greedy reply G times)")
        fix = "sample at temperature 0.7-1.0 (TRL's default 1.0)"
    else:
        cause = ("the task is too hard or too easy for the model, the reward is all-or-nothing, "
                 "or G is small; after a collapse every completion of a group is the same")
        fix = ("more generations per prompt (G), partial credit in the reward, "
               "dynamic_sampling=True, or data nearer the model's level")
    return d.finding(
        "no_learning_signal", "most groups have no reward spread: nothing to learn from",
        evidence, cause, fix, "healthy course runs: 10-40 % of groups without spread")


def entropy_out_of_range(d: Doctor) -> Finding | None:
    values = _values(d.records, ENTROPY, None)
    if len(values) < ENTROPY_START + ENTROPY_NOW:
        return None
    start, now = _mean(values[:ENTROPY_START]), _mean(values[-ENTROPY_NOW:])
    if abs(now - start) < ENTROPY_MIN_MOVE:
        return None
    if now < ENTROPY_COLLAPSE * start:
        rewards = _values(d.records, REWARD, None)
        first = _mean(rewards[:ENTROPY_NOW]) if len(rewards) >= 2 * ENTROPY_NOW else None
        if first is not None and max(_mean(rewards[-n:]) - first for n in CONVERGED_WINDOWS
                                     if len(rewards) >= ENTROPY_NOW + n) >= CONVERGED_REWARD:
            return None  # converging on the rewarded replies: the reward rose with the collapse
        code, title, threshold = ("entropy_collapsed", "entropy collapsed",
                                  ENTROPY_COLLAPSE * start)
    elif now > ENTROPY_EXPLODE * start:
        code, title, threshold = ("entropy_exploded", "entropy exploded",
                                  ENTROPY_EXPLODE * start)
    else:
        return None
    return d.finding(
        code, f"{title} against the run's start",
        {"metric": ENTROPY, "window": ENTROPY_NOW, "value": now, "start": start,
         "threshold": threshold},
        "a learning rate too high, or a reward the policy games; collapsed (while the reward did "
        "not rise): the G completions of a group become the same; exploded: the policy samples "
        "noise",
        "lower the learning rate, add a KL term (beta > 0), or fix the reward",
        "healthy course runs keep entropy within 0.5-1.5x its start")


def reward_flat(d: Doctor) -> Finding | None:
    rewards = _values(d.records, REWARD, None)
    moves = _values(d.records, "grad_norm", d.window)
    if len(rewards) < FLAT_STEPS or not moves or max(moves) <= 0:
        return None
    start, now = _mean(rewards[:d.window]), _mean(rewards[-d.window:])
    if now - start > FLAT_REWARD or max(rewards) <= 0 or min(rewards) >= 1:
        return None
    if len(d.accuracies) >= 2 and max(d.accuracies[1:]) - d.accuracies[0] >= FLAT_ACCURACY:
        return None  # greedy accuracy on held-out problems rose: it learns
    small_lr = d.learning_rate is not None and d.learning_rate < SMALL_LEARNING_RATE
    return d.finding(
        "reward_flat", "the reward has not risen since the start",
        {"metric": REWARD, "window": d.window, "steps": len(rewards), "start": start,
         "now": now, "threshold": FLAT_REWARD, "learning_rate": d.learning_rate,
         "eval_accuracy": [d.accuracies[0], d.accuracies[-1]] if d.accuracies else None},
        (f"learning_rate={d.learning_rate:g} is too small to move the weights; or " if small_lr
         else "") + "no learning signal reaches the update (groups without spread, a learning "
        "rate too small), or the samples do not come from the policy being trained",
        "read frac_reward_zero_std and kl; raise the learning rate; check the adapter reaches "
        "the replicas",
        "healthy course runs gain 10-40 points of accuracy over 150 steps")


def sampler_mismatch(d: Doctor) -> Finding | None:
    if "version" not in d.records[-1]:
        return None  # the synchronous trainer's kl is against the reference model
    kls = _values(d.records, KL, d.window)
    bound = SAMPLER_KL[d.correction]
    if len(kls) < d.window or median(kls) <= bound:
        return None
    return d.finding(
        "sampler_mismatch", "the sampler's policy is further from the trainer's than the "
        f"objective in use ({d.correction}) can correct",
        {"metric": KL, "window": len(kls), "value": median(kls), "threshold": bound},
        "the replicas serve other weights (stale, another precision, the base model), or the "
        "samples are too stale",
        "lower max_staleness, sync weights more often, or use a correction "
        "(vllm_importance_sampling_mode)",
        "on-policy ~1e-9, staleness 1 ~1e-4, a bf16 sampler ~2e-4")


def not_from_policy(d: Doctor) -> Finding | None:
    kls = _values(d.records, KL, None)
    versions = _values(d.records, "version", None)
    if "version" not in d.records[-1] or len(kls) < 3 * d.window or len(set(versions)) < 3:
        return None
    w = d.window
    first, before, now = median(kls[:w]), median(kls[-3 * w:-2 * w]), median(kls[-w:])
    if now <= NOT_FROM_POLICY_KL or now < NOT_FROM_POLICY_GROWTH * max(before, first):
        return None
    return d.finding(
        "not_from_policy", "the samples do not come from the trained policy",
        {"metric": KL, "window": d.window, "value": now, "two_windows_before": before,
         "first_window": first, "growth": now / max(before, first, 1e-12),
         "threshold": NOT_FROM_POLICY_GROWTH,
         "versions": len(set(versions))},
        "the trainer publishes new versions but the replicas' policy drifts further from it: the "
        "adapter never reached them, the base model answers under the adapter's name, or a "
        "reused adapter name serves stale weights",
        "check `grpo-lab doctor RUN_DIR` (it asks the replicas' /v1/models), the bucket's "
        "mount, and that each version gets a new adapter name",
        "kl stays near its start (~1e-4) when the replicas follow the trainer")


def staleness_pinned(d: Doctor) -> Finding | None:
    if d.max_staleness is None:
        return None
    stale = _values(d.records, STALE_MEAN, d.window)
    dropped = _values(d.records, DROPPED, d.window + 1)
    # every sample at the bound (the mean, not the max: the max touches it in healthy runs).
    # At max_staleness 1 that is the design (generation one version ahead), not a finding.
    pinned = d.max_staleness > 1 and len(stale) == d.window and min(stale) >= d.max_staleness
    dropping = len(dropped) == d.window + 1 and all(
        b > a for a, b in zip(dropped, dropped[1:]))
    if not (pinned or dropping):
        return None
    return d.finding(
        "staleness_pinned", "staleness is pinned at its maximum" if pinned
        else "groups are dropped as stale every step",
        {"metric": STALE_MEAN if pinned else DROPPED, "window": d.window,
         "value": stale[-1] if pinned else dropped[-1] - dropped[0],
         "threshold": d.max_staleness},
        "generation runs far ahead of the trainer: the buffer holds old groups",
        "lower the client's in-flight cap or the buffer size, or speed up the trainer",
        "healthy course runs: staleness mostly below its maximum, few drops")


def learning_rate_too_high(d: Doctor) -> Finding | None:
    clips = _values(d.records, CLIP, d.window)
    if not clips or max(clips) < CLIP_SHARE:
        return None
    return d.finding(
        "learning_rate_too_high", "the updates move the policy too far: clip ratios spike",
        {"metric": CLIP, "window": len(clips), "value": max(clips), "threshold": CLIP_SHARE},
        "a learning rate too high for the model (or many updates per batch)",
        "lower the learning rate (LoRA ~1e-5 to 1e-4 at real scale) or num_iterations",
        "healthy course runs clip 0-2 % of tokens")


def policy_not_moving(d: Doctor) -> Finding | None:
    rewards, entropy = _values(d.records, REWARD, None), _values(d.records, ENTROPY, None)
    steps = len(d.records)
    if d.learning_rate is None or len(rewards) < d.window or len(entropy) < d.window:
        return None
    reach = d.learning_rate * steps  # Adam moves a weight by about the learning rate a step
    start, now = _mean(entropy[:ENTROPY_START]), _mean(entropy[-ENTROPY_NOW:])
    if reach >= MOVE_REACH or (
            _mean(rewards[-ENTROPY_NOW:]) - _mean(rewards[:ENTROPY_NOW]) >= FLAT_REWARD):
        return None
    return d.finding(
        "policy_not_moving", "the policy cannot have moved: the learning rate is too small",
        {"metric": ENTROPY, "window": steps, "start": start, "value": now,
         "learning_rate": d.learning_rate, "reach": reach, "threshold": MOVE_REACH},
        f"learning_rate={d.learning_rate:g} is too small to move the weights: Adam moves each "
        f"weight by about the learning rate a step, {reach:.1g} in all over {steps} steps",
        "raise the learning rate (LoRA on the course's models: 1e-4 to 1e-3; full fine-tuning "
        "of small models: 1e-5 to 1e-4)",
        "healthy course runs can move a weight by 5e-3 to 1e-2 within 10 steps")


CHECKS = (completions_cut, no_learning_signal, entropy_out_of_range, reward_flat,
          sampler_mismatch, not_from_policy, staleness_pinned, learning_rate_too_high,
          policy_not_moving)
"""What every run is checked for. The pipeline's bottleneck (`bottleneck`, below)
joins them where the pipeline's diagnosis is at hand: `Doctor(checks=CHECKS + (bottleneck,))`."""


def chat_template_finding(tokenizer, prompt, step: int = 0) -> Finding | None:
    """The chat template not applied: the model's tokenizer has one and a prompt sent to it is a
    plain string that does not start as the template starts."""
    template = getattr(tokenizer, "chat_template", None)
    if not template or not isinstance(prompt, str):
        return None
    templated = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    opening = templated.split("x", 1)[0][:12]
    if opening and prompt.startswith(opening):
        return None
    return Finding(
        "chat_template_skipped", "prompts skip the model's chat template", step,
        {"prompt_starts": prompt[:30], "template_starts": opening},
        "a string prompt goes to a chat model as plain text: it answers off-distribution and "
        "often never stops", "give conversational prompts ([{'role': 'user', ...}]) or apply "
        "tokenizer.apply_chat_template", "a chat model's prompts start with its template")


def make_doctor(config) -> Doctor | None:
    """The doctor a trainer's config asks for (`doctor=False`: none): the asynchronous trainer's
    bound on staleness and its sampler correction, when it has them."""
    if not getattr(config, "doctor", True):
        return None
    corrected = getattr(config, "vllm_importance_sampling_correction", False)
    asynchronous = getattr(config, "asynchronous", False)
    return Doctor(correction="tis" if corrected else "none",
                  max_staleness=getattr(config, "max_staleness", None) if asynchronous else None,
                  temperature=getattr(config, "temperature", None),
                  # only for LoRA: full fine-tuning of a large model at 1e-6 (TRL's default)
                  # moves slowly but does move, and a TRL config does not say which it is
                  learning_rate=config.learning_rate if getattr(config, "use_lora", False)
                  else None)


# ------------------------------------------------------------ the pipeline's finding
# The run doctor's pipeline finding: which side of the rollout buffer holds the run back.
#
# A note, not a problem: some side always sets the pace (on 2 CPU cores, the trainer does).
#
# `bottleneck` is a check of grpo_lab.watch.doctor's kind, made of `diagnose` (this stage's
# reading of the queue, the waits and the backpressure); `pipeline_doctor()` is a Doctor with it.


KNOBS = {"trainer": "speed up the step: packing, a bigger token budget, no gradient "
                    "checkpointing; adding replicas will not help",
         "generation": "add replicas or lift the client's in-flight cap"}


def bottleneck(d: Doctor) -> Finding | None:
    """The existing diagnosis over the last two windows, once it names a side."""
    if len(d.records) < 2 * d.window:
        return None
    diagnosis = diagnose(d.records, window=2 * d.window)
    if diagnosis.bottleneck not in KNOBS:
        return None
    numbers = {k: round(v, 3) for k, v in diagnosis.numbers.items() if isinstance(v, float)}
    return d.finding(
        f"bottleneck_{diagnosis.bottleneck}", f"the {diagnosis.bottleneck} holds the run back",
        {"metric": "sample/rollout_queue_size", "window": 2 * d.window, **numbers},
        diagnosis.verdict, KNOBS[diagnosis.bottleneck],
        "a balanced pipeline: the queue neither full nor empty, little waiting on either side",
        kind="note")


def pipeline_doctor(**kwargs) -> Doctor:
    """A Doctor that also names the pipeline's bottleneck."""
    return Doctor(checks=CHECKS + (bottleneck,), **kwargs)


# ------------------------------------------------------------ the pipeline's reading (diagnose)
# Which side of the rollout buffer holds a run back: `diagnose`, from the per-step metrics.
#
# `diagnose` applies docs/recipe.md's rule ("Reading the pipeline"):
#     full queue  + zero wait   + high backpressure  = the trainer is too slow
#     empty queue + rising wait + no backpressure    = generation is too slow
# Generation is held back by a full buffer (`rollout/backpressure_total_s`) or, in grpo_lab's
# async trainer, by the admission rule that keeps samples within max_staleness
# (`rollout/version_wait_s`): both mean generation is ahead, so both count as backpressure.
# The metric names below are the ones the asynchronous trainer logs (grpo_lab.rollout; how they
# map to TRL's: grpo_lab.watch.metric_names.TRL_ASYNC_NAMES).


QUEUE, QUEUE_MAX = "sample/rollout_queue_size", "sample/rollout_queue_maxsize"
WAIT, BACKPRESSURE = "perf/rollout_wait_s", "rollout/backpressure_total_s"
VERSION_WAIT = "rollout/version_wait_s"
INFLIGHT = "rollout/inflight_max"
STEP, FWD_BWD, SYNC = "perf/step_s", "perf/fwd_bwd_s", "perf/weight_sync_s"
STALE_MEAN, STALE_MAX = "sample/staleness_mean", "sample/staleness_max"


class Diagnosis(NamedTuple):
    bottleneck: str
    """`trainer`, `generation`, `balanced`, or `unknown` (no queue metrics)."""
    verdict: str
    """One sentence, with the numbers that decided it."""
    numbers: dict
    """steps, queue_fill, rollout_wait_s, wait_share, wait_slope_s, backpressure_s,
    version_wait_s, held_back_share, fwd_bwd_share (per-step means or shares of step time,
    over the window)."""


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys against xs (0 for fewer than 2 points)."""
    if len(xs) < 2:
        return 0.0
    mx, my = _mean(xs), _mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def diagnose(records: Iterable[dict], window: int = 20, *, full: float = 0.75,
             empty: float = 0.25, idle: float = 0.05, busy: float = 0.2) -> Diagnosis:
    """Which side of the rollout buffer holds the run back, over the last `window` steps.

    `full`/`empty`: queue fill (size / max size) that counts as full / empty. Waits are compared
    to the step time: a share under `idle` is "zero" / "no", a share over `busy` is "high".
    """
    rows = [r for r in records if r.get(QUEUE_MAX) and STEP in r][-window:]
    if not rows:
        return Diagnosis("unknown", "no pipeline metrics yet (a synchronous run has no queue)", {})
    step_time = sum(r[STEP] for r in rows) or 1e-9
    waits = [r.get(WAIT, 0.0) for r in rows]
    n = {
        "steps": len(rows),
        "queue_fill": _mean([r[QUEUE] / r[QUEUE_MAX] for r in rows]),
        "rollout_wait_s": _mean(waits),
        "wait_share": sum(waits) / step_time,
        "wait_slope_s": _slope([r.get("step", i) for i, r in enumerate(rows)], waits),
        "backpressure_s": _mean([r.get(BACKPRESSURE, 0.0) for r in rows]),
        "version_wait_s": _mean([r.get(VERSION_WAIT, 0.0) for r in rows]),
        "held_back_share": sum(r.get(BACKPRESSURE, 0.0) + r.get(VERSION_WAIT, 0.0)
                               for r in rows) / step_time,
        "fwd_bwd_share": sum(r.get(FWD_BWD, 0.0) for r in rows) / step_time,
    }
    facts = (f"queue {n['queue_fill']:.0%} full, trainer waits {n['rollout_wait_s']:.2f} s/step "
             f"({n['wait_share']:.0%} of a step), generation held back "
             f"{n['backpressure_s'] + n['version_wait_s']:.2f} s/step ({n['held_back_share']:.0%})")
    if n["queue_fill"] >= full and n["wait_share"] <= idle and n["held_back_share"] >= busy:
        return Diagnosis("trainer", f"trainer too slow: {facts}. Generation is throttled by a "
                         "full buffer; speed up the step (packing, no gradient checkpointing) "
                         "before adding replicas.", n)
    rising = n["wait_share"] >= busy or (n["wait_slope_s"] > 0 and n["wait_share"] > idle)
    if n["queue_fill"] <= empty and rising and n["held_back_share"] <= idle:
        return Diagnosis("generation", f"generation too slow: {facts}. The trainer starves; "
                         "add replicas or lift the client's cap on in-flight requests.", n)
    return Diagnosis("balanced", f"neither side clearly waits for the other: {facts}.", n)

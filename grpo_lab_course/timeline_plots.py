"""Synchronous against asynchronous GRPO as a timeline, drawn from the runs' logged step times.

`step_spans(records)` turns one run's per-step records (AsyncGRPOTrainer's `time_s`,
`perf/step_s`, `perf/rollout_wait_s`, `rollout/version_wait_s`, `rollout/backpressure_total_s`)
into spans on two lanes, generation and training; `plot_timeline(runs)` draws them for a window
of steps, one pair of lanes per run, beside `buffer_versions(records)`: the trainer's version and
the versions of the samples it trained on, against time. `staleness_summary(records)` sums up
what those versions cost: staleness, drops, and the sampler-against-trainer distance.

What is logged, and so what is drawn:
- a synchronous step (`perf/generate_s` logged) is generation, then training, in one thread: the
  generation span is the step's rollout wait, the training span the rest of the step;
- an asynchronous step's trainer lane is its wait for the buffer, then training; its worker lane
  is the worker's busy time in that step, the step's time less the time the worker was held back
  (`rollout/version_wait_s` + `rollout/backpressure_total_s`). Where in the step it fell is not
  logged; it is drawn first, the held-back time last (the version gate opens at a publish, which
  ends a step).
"""

from __future__ import annotations

from typing import NamedTuple

GENERATE, TRAIN, IDLE = "#0072B2", "#E69F00", "#BBBBBB"  # Okabe-Ito blue, orange; grey


class Span(NamedTuple):
    """One stretch of one lane: `kind` is "generate", "train" or "idle"."""

    step: int
    lane: str  # "generation" or "training"
    kind: str
    start: float  # seconds since the run's steps started
    seconds: float


def is_synchronous(records: list[dict]) -> bool:
    """A synchronous run logs `perf/generate_s` (generation inline, in the trainer's thread)."""
    return any("perf/generate_s" in r for r in records)


def step_spans(records: list[dict]) -> list[Span]:
    """The spans of every step of one run, in step order (see the module's docstring)."""
    sync = is_synchronous(records)
    spans = []
    for r in records:
        step, total = r["step"], r["perf/step_s"]
        start, wait = r["time_s"] - total, min(r["perf/rollout_wait_s"], total)
        if sync:  # generate, then train, one after the other
            spans += [Span(step, "generation", "generate", start, wait),
                      Span(step, "training", "train", start + wait, total - wait),
                      Span(step, "generation", "idle", start + wait, total - wait),
                      Span(step, "training", "idle", start, wait)]
            continue
        held = r.get("rollout/version_wait_s", 0.0) + r.get("rollout/backpressure_total_s", 0.0)
        busy = max(0.0, total - min(held, total))
        spans += [Span(step, "training", "idle", start, wait),
                  Span(step, "training", "train", start + wait, total - wait),
                  Span(step, "generation", "generate", start, busy),
                  Span(step, "generation", "idle", start + busy, total - busy)]
    return spans


def busy_share(records: list[dict]) -> dict[str, float]:
    """{lane: the share of the run's time that lane computed}: what overlap buys, in one number
    per lane (a synchronous run's two shares add up to 1)."""
    spans = step_spans(records)
    total = sum(r["perf/step_s"] for r in records)
    return {lane: sum(s.seconds for s in spans if s.lane == lane and s.kind != "idle") / total
            for lane in ("generation", "training")}


def buffer_versions(records: list[dict]) -> list[tuple[float, int, float, float]]:
    """`[(time_s, trainer version, mean version of the samples trained, oldest version)]` per
    step. The trainer trains at `version - 1` (each step publishes one version, which `version`
    already counts); a sample `k` versions stale was generated at that version less k."""
    rows = []
    for r in records:
        trained_at = r["version"] - 1
        rows.append((r["time_s"], trained_at, trained_at - r["sample/staleness_mean"],
                     trained_at - r["sample/staleness_max"]))
    return rows


def staleness_summary(records: list[dict]) -> dict[str, float]:
    """A run's staleness (mean, max), the completions it dropped as too stale, the largest
    |ratio - 1| of a step, and the logged k3 `kl` of the sampler against the trainer: its
    largest |value| and its mean over the steps whose samples were stale (0 when none were)."""
    stale_kl = [r["kl"] for r in records if r["sample/staleness_mean"] > 0] or [0.0]
    return dict(staleness_mean=sum(r["sample/staleness_mean"] for r in records) / len(records),
                staleness_max=max(r["sample/staleness_max"] for r in records),
                dropped=sum(r.get("sample/dropped_stale_total", 0) for r in records),
                ratio_deviation=max(abs(r["ratio"] - 1) for r in records),
                kl_max=max(abs(r["kl"]) for r in records),
                kl_stale_mean=sum(stale_kl) / len(stale_kl))


def _window(records: list[dict], steps: tuple[int, int] | None) -> list[dict]:
    if steps is None:
        return records
    return [r for r in records if steps[0] <= r["step"] <= steps[1]]


def plot_timeline(runs: dict[str, list[dict]], steps: tuple[int, int] | None = (11, 16), *,
                  versions_of: str | None = "async",
                  versions_steps: tuple[int, int] | None = (1, 20)):
    """The timeline of each run (name -> records) over `steps` (first, last; None: all), time
    counted from the window's start so the runs line up; and, when `versions_of` names a run,
    that run's `buffer_versions` over `versions_steps`. Pick windows without an evaluation: it
    runs between two steps and shows as a gap. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    wide = versions_of in runs
    fig, axes = plt.subplots(1, 2 if wide else 1, figsize=(14 if wide else 9, 3.8),
                             gridspec_kw={"width_ratios": [2.2, 1]} if wide else None,
                             squeeze=False)
    ax = axes[0][0]
    labels, ticks, y = [], [], 0
    colour = {"generate": GENERATE, "train": TRAIN, "idle": IDLE}
    for name, records in runs.items():
        window = _window(records, steps)
        if not window:
            continue
        origin = window[0]["time_s"] - window[0]["perf/step_s"]
        spans = step_spans(window)
        for lane in ("training", "generation"):
            mine = [s for s in spans if s.lane == lane and s.seconds > 0]
            ax.broken_barh([(s.start - origin, s.seconds) for s in mine], (y - 0.35, 0.7),
                           facecolors=[colour[s.kind] for s in mine], edgecolor="white",
                           linewidth=0.8)
            labels.append(f"{name}: {lane}")
            ticks.append(y)
            y += 1
        for r in window:  # step boundaries, numbered on the training lane
            end = r["time_s"] - origin
            ax.axvline(end, ymin=0, ymax=1, color="black", linewidth=0.3, alpha=0.3)
            ax.text(end - r["perf/step_s"] / 2, y - 2, str(r["step"]), ha="center",
                    va="center", fontsize=7)
        y += 0.5
    ax.set_yticks(ticks, labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the window's first step began")
    shown = f"steps {steps[0]}-{steps[1]}" if steps else "all steps"
    ax.set_title(f"what each lane did, {shown} (numbers: the step)")
    ax.legend(handles=[Patch(color=GENERATE, label="generate"), Patch(color=TRAIN, label="train"),
                       Patch(color=IDLE, label="waits")], loc="upper center", ncol=3,
              bbox_to_anchor=(0.5, -0.2), fontsize=9, frameon=False)
    if wide:
        rows = buffer_versions(_window(runs[versions_of], versions_steps))
        t, trainer, mean, oldest = zip(*rows)
        ax2 = axes[0][1]
        ax2.plot(t, trainer, "-", color="black", label="trainer's version")
        ax2.fill_between(t, oldest, trainer, color=IDLE, alpha=0.5, label="the samples' lag")
        ax2.plot(t, mean, ".", markersize=4, color=GENERATE, label="samples' mean version")
        ax2.set(xlabel="wall time (s)", ylabel="policy version",
                title=f"{versions_of}: versions trained on"
                + (f", steps {versions_steps[0]}-{versions_steps[1]}" if versions_steps else ""))
        ax2.legend(fontsize=8, loc="upper left")
        ax2.grid(alpha=0.3)
    fig.tight_layout()
    return fig

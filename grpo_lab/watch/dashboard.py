"""Watch an asynchronous run: a live panel in a notebook, a text line elsewhere.

    dash = Dashboard(stats=lambda: proxy_stats("http://127.0.0.1:8000"))  # the router's counters
    trainer.train(callback=dash.update)          # a trainer callback, or tail a run's file:
    dash.follow(run_dir, until=lambda: not run.running("trainer"))

The panel holds a status line with `diagnose`'s verdict, the run doctor's findings (each once,
as it appears: grpo_lab.watch.doctor) and the pipeline plots that have data (docs/internals.md,
"The dashboard").
"""

from __future__ import annotations

import html
import io
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..util.files import JsonlTail
from .doctor import (
    BACKPRESSURE,
    INFLIGHT,
    QUEUE,
    QUEUE_MAX,
    STALE_MAX,
    STALE_MEAN,
    STEP,
    SYNC,
    VERSION_WAIT,
    WAIT,
    diagnose,
    pipeline_doctor,
)
from .live_stats import router_counters
from .metrics import moving_average, series
from .plots import PIPELINE_PANELS, draw_panel, grid_shape, has_data, panel_axes, ratio_axis


def in_notebook() -> bool:
    """True inside a Jupyter kernel (papermill included), where widgets can be shown."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class Dashboard:
    """Live view of a run. `update(record)` per step (a trainer callback: it draws in the
    caller's thread) or `follow(run_dir)` (tails the run's metrics.jsonl).

    `stats`: a callable returning the proxy's router counters (e.g. `proxy_stats(url)`), polled
    at each redraw. `notebook`: force the widget panel (True) or the text line (False).
    Redraws come at most every `min_interval_s`, and drawing takes at most `max_busy` of the
    time (a matplotlib redraw costs ~0.3 s of CPU that the trainer would rather have; None =
    no such limit).
    """

    def __init__(self, *, stats: Callable[[], dict] | None = None, min_interval_s: float = 0.5,
                 max_busy: float | None = 0.1, notebook: bool | None = None, stream=None,
                 title: str = "GRPO pipeline", doctor=None):
        self.records: list[dict] = []
        # `doctor`: a grpo_lab.watch.doctor.Doctor (its run's max_staleness and correction);
        # default: one that knows neither. `findings`: what it has named so far.
        self.doctor = doctor if doctor is not None else pipeline_doctor()
        self.findings: list = []
        self.stats, self.min_interval_s, self.title = stats, min_interval_s, title
        self.max_busy = max_busy
        self.stream = stream or sys.stdout
        self.notebook = in_notebook() if notebook is None else notebook
        self.renders = 0
        self.panels: list[str] = []
        """Titles of the plots in the last picture (listed under the status line in a notebook)."""
        self._next_render = float("-inf")
        self._pending = False
        self._lock = threading.Lock()
        self.widget = None
        if self.notebook:
            import ipywidgets as widgets
            from IPython.display import display
            from matplotlib.backends import backend_agg  # noqa: F401  imported now, not in a step

            self._text = widgets.HTML()
            self._image = widgets.Image(format="png")
            self.widget = widgets.VBox([self._text, self._image])
            self.widget.add_class("grpo-lab-dashboard")  # a handle for styles and browser tests
            display(self.widget)

    # -- feeding it ----------------------------------------------------------------------------
    def update(self, record: dict) -> None:
        """Add one step's metrics; redraw unless the last redraw is too recent."""
        with self._lock:
            self.records.append(dict(record))
            self._pending = True
            new = self.doctor.observe(dict(record))
            self.findings += new
        if new and not self.notebook:  # in a notebook the panel lists them
            for finding in new:
                print(finding.text(), file=self.stream, flush=True)
        self.render()

    __call__ = update

    def follow(self, path: str | Path, *, until: Callable[[], bool] | None = None,
               timeout_s: float | None = None, poll_s: float = 0.5, background: bool = False):
        """Tail a metrics.jsonl (or a run folder holding one) until `until()` is true, the
        timeout passes, or Ctrl-C / the notebook's interrupt. Returns how many records it read;
        with `background=True` it returns at once a follower whose `.stop()` ends it (drawing
        then happens off the caller's thread, e.g. off a trainer's)."""
        if background:
            return _Follower(self, path, until, timeout_s, poll_s)
        return self._follow(path, until, timeout_s, poll_s)

    def _follow(self, path, until, timeout_s, poll_s) -> int:
        path = Path(path)
        path = path / "metrics.jsonl" if path.is_dir() or not path.suffix else path
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        tail, count = JsonlTail(path), 0  # by offset; starts over when a resume trims the file
        try:
            while True:
                done = bool(until and until())  # decided before the read: no line is missed
                for record in tail.read_new():
                    self.update(record)
                    count += 1
                if done or (deadline is not None and time.monotonic() >= deadline):
                    break
                time.sleep(poll_s)
        except KeyboardInterrupt:
            pass  # stop following, keep the picture
        self.flush()
        return count

    # -- drawing -------------------------------------------------------------------------------
    def flush(self) -> None:
        """Redraw now if anything arrived since the last redraw."""
        if self._pending:
            self.render(force=True)

    def render(self, force: bool = False) -> bool:
        """Redraw (throttled unless `force`); returns whether it drew."""
        start = time.monotonic()
        if not force and start < self._next_render:
            return False
        with self._lock:
            records, self._pending = list(self.records), False
        router = self._router()
        line = self.line(records, router)
        if self.notebook:
            self._image.value = self._png(records, router)
            found = "".join(f"<br><b style='color: #b2182b'>doctor, step {f.step}: "
                            f"{html.escape(f.title)}</b> <small>({html.escape(f.fix)})</small>"
                            for f in self.findings)
            self._text.value = (f"<code>{html.escape(line)}</code>{found}<br>"
                                f"<small style='color: gray'>{html.escape(self.caption())}</small>")
        else:
            print(line, file=self.stream, flush=True)
        self.renders += 1
        # The first picture also pays matplotlib's one-off set-up (fonts, ~0.5 s): throttling the
        # next one by it would freeze the panel for ~10 s at max_busy 0.1.
        spent = time.monotonic() - start if self.renders > 1 else 0.0
        throttle_s = spent / (self.max_busy or float("inf"))
        self._next_render = start + max(self.min_interval_s, throttle_s)
        return True

    def caption(self) -> str:
        """Which plots the picture holds, and which pipeline plots wait for data (a synchronous
        run never logs them)."""
        waiting = [p.title for p in PIPELINE_PANELS if p.title not in self.panels]
        return ("plots: " + ", ".join(self.panels)
                + ("; no data for: " + ", ".join(waiting) if waiting else ""))

    def _router(self) -> dict | str:
        if self.stats is None:
            return {}
        try:
            return router_counters(self.stats())
        except Exception as exc:  # the proxy may be down or not up yet: show it, keep going
            return f"router stats unavailable ({type(exc).__name__})"

    @staticmethod
    def line(records: list[dict], router: dict | str | None = None) -> str:
        """One status line: the latest step's pipeline numbers, the verdict, router counters."""
        if not records:
            return "waiting for the first step"
        r = records[-1]

        def get(key, fmt="{:.2f}"):
            return fmt.format(r[key]) if key in r else "-"

        parts = [f"step {r.get('step', len(records))}", f"reward {get('reward', '{:.3f}')}",
                 f"ratio {get('ratio', '{:.4f}')}"]
        # The pipeline's numbers, those this run logs (a synchronous run has no queue).
        shown = ((STALE_MEAN,
                  lambda: f"staleness {get(STALE_MEAN, '{:.1f}')}/{get(STALE_MAX, '{:g}')}"),
                 (QUEUE, lambda: f"queue {get(QUEUE, '{:g}')}/{get(QUEUE_MAX, '{:g}')}"),
                 (WAIT, lambda: f"wait {get(WAIT)}s"),
                 (BACKPRESSURE, lambda: f"backpressure {get(BACKPRESSURE)}s"),
                 (VERSION_WAIT, lambda: f"version wait {get(VERSION_WAIT)}s"),
                 (STEP, lambda: f"step time {get(STEP)}s"), (SYNC, lambda: f"sync {get(SYNC)}s"))
        parts += [text() for key, text in shown if key in r]
        if INFLIGHT in r:
            parts.append(f"in flight {get(INFLIGHT, '{:g}')}")
        diagnosis = diagnose(records)
        if diagnosis.bottleneck in ("trainer", "generation"):
            parts.append(f"{diagnosis.bottleneck} too slow")
        if isinstance(router, dict) and router:
            parts.append("router " + " ".join(f"{k} {v}" for k, v in router.items()))
        elif router:
            parts.append(str(router))
        return " | ".join(parts)

    def figure(self, records: list[dict] | None = None, router: dict | str | None = None):
        """The panel's picture as a matplotlib Figure (no pyplot: nothing shown twice): reward
        and ratio, the router when there are stats, and the pipeline plots that have data, in
        one grid without empty cells (grpo_lab.watch.plots.grid_shape)."""
        from matplotlib.figure import Figure

        records = self.records if records is None else records
        pipeline = [p for p in PIPELINE_PANELS if has_data(records, p)]
        n = 2 + bool(router) + len(pipeline)
        rows, _ = grid_shape(n)
        # Constrained layout keeps titles, tick labels and the figure title apart.
        fig = Figure(figsize=(14, 0.7 + 2.7 * rows), dpi=72, layout="constrained")
        axes = panel_axes(fig, n)
        ax_reward, ax_ratio = axes[:2]
        xs, ys = series(records, "reward")
        if xs:
            ax_reward.plot(xs, ys, alpha=0.4, label="reward")
            ax_reward.plot(xs, moving_average(ys), label="moving avg")
            ax_reward.legend(fontsize=7)
        ax_reward.set_title("reward", fontsize=9)
        xs, ys = series(records, "ratio")
        ax_ratio.plot(xs, ys)
        ax_ratio.axhline(1.0, color="gray", lw=0.8, ls=":")
        ax_ratio.set_title("ratio (pi_theta / pi_old)", fontsize=9)
        ratio_axis(ax_ratio, ys)
        for ax in (ax_reward, ax_ratio):
            ax.grid(alpha=0.3)
        if router:
            draw_router(axes[2], router)
        for ax, panel in zip(axes[2 + bool(router):], pipeline):
            draw_panel(ax, records, panel)
        fig.suptitle(self.title, fontsize=10)
        return fig

    def _png(self, records, router) -> bytes:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        fig = self.figure(records, router)
        buffer = io.BytesIO()
        FigureCanvasAgg(fig).print_png(buffer)
        self.panels = [ax.get_title() for ax in fig.axes]
        return buffer.getvalue()


def draw_router(ax, router: dict | str) -> None:
    """The router's counters as bars (affinity, spilled, unmatched), routed and the replicas'
    cache hit rate in the title; a message when the stats could not be read."""
    counters = router if isinstance(router, dict) else {}
    kinds = [k for k in ("affinity", "spilled", "unmatched") if k in counters]
    ax.bar(kinds, [counters[k] for k in kinds], color=["C2", "C1", "C3"][: len(kinds)])
    routed = counters.get("routed")
    hit_rate = counters.get("cache_hit_rate")
    ax.set_title("router" + (f" (routed {routed})" if routed is not None else
                             "" if counters else ": no stats")
                 + (f", cache hits {hit_rate:.0%}" if hit_rate is not None else ""), fontsize=9)
    ax.grid(alpha=0.3)


class _Follower:
    """`Dashboard.follow(..., background=True)`: the tail loop in a daemon thread."""

    def __init__(self, dashboard: Dashboard, path, until, timeout_s, poll_s):
        self._stop, self.poll_s = threading.Event(), poll_s
        self.thread = threading.Thread(
            target=dashboard._follow, daemon=True, name="dashboard-follow",
            args=(path, lambda: self._stop.is_set() or bool(until and until()), timeout_s, poll_s))
        self.thread.start()

    def running(self) -> bool:
        return self.thread.is_alive()

    def stop(self) -> None:
        """Read what is left, draw it, and end the thread."""
        self._stop.set()
        self.thread.join(timeout=self.poll_s + 30)

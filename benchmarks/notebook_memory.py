"""Peak memory of a course notebook run: the kernel and every process it starts, as a learner's
machine counts them (mybinder.org gives about 2 GB, so every notebook aims at < 2,048 MiB).

    python benchmarks/notebook_memory.py 07            # one notebook, its exercises solved
    python benchmarks/notebook_memory.py 04 05 07      # several, one after the other
    GRPO_LAB_VLLM=off python benchmarks/notebook_memory.py 05   # as on mybinder.org (no vLLM)

Each notebook runs under papermill (`grpo_lab_course.notebooks.run_notebook`, with its solutions, as
the tests run it). Every 0.5 s a thread finds the kernel (this process's child running
`ipykernel_launcher`) and sums the proportional set size (PSS) of it and all its descendants:
PSS splits each shared page (torch's libraries, mapped by every process that imports it) between
the processes that map it, so the sum is what the run takes from the machine, with nothing
counted twice. The largest sum is the peak; the processes of that moment are kept too, and so
is the largest sum of resident sizes (RSS), which counts shared pages once per process.
Results (peak PSS MiB, wall seconds, the processes at the peak) are merged into
benchmarks/results/notebook_memory.json and printed. Run it alone on the machine: its timing
is the notebook's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from grpo_lab.serve.process import vllm_missing_reason  # noqa: E402
from grpo_lab_course.goals import missed_goals  # noqa: E402
from grpo_lab_course.notebooks import find_notebook, run_notebook  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "notebook_memory.json"
BUDGET_MIB = 2048
"""mybinder.org's memory limit, about 2 GB: what every notebook's peak must stay under."""
MIB = 2 ** 20


def _kernel() -> psutil.Process | None:
    for child in psutil.Process().children():
        try:
            if any("ipykernel" in part for part in child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


def _label(proc: psutil.Process) -> str:
    """A short name for a process: `kernel`, or what `grpo_lab.cli` runs (`serve`, `proxy`, ...)."""
    try:
        args = proc.cmdline()
    except psutil.Error:
        return "gone"
    if any("ipykernel" in a for a in args):
        return "kernel"
    if "grpo_lab.cli" in args:
        rest = args[args.index("grpo_lab.cli") + 1:]
        return rest[0] if rest else "grpo-lab"
    return Path(args[0]).name if args else proc.name()


class PssSampler:
    """Samples the kernel's tree every `interval_s` in a thread; `peak_mib` and `at_peak`."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s, self.peak_mib, self.at_peak, self.samples = interval_s, 0.0, [], 0
        self.peak_rss_mib = 0.0  # the resident sizes summed: shared libraries once per process
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> list[tuple[str, float, float]]:
        """(label, PSS MiB, RSS MiB) of the kernel and each of its descendants."""
        kernel = _kernel()
        if kernel is None:
            return []
        try:
            tree = [kernel, *kernel.children(recursive=True)]
        except psutil.Error:
            return []
        sizes = []
        for proc in tree:
            try:
                info = proc.memory_full_info()
            except psutil.Error:  # exited between the listing and the read
                continue
            sizes.append((_label(proc), info.pss / MIB, info.rss / MIB))
        return sizes

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            sizes = self.sample()
            self.samples += 1
            self.peak_rss_mib = max(self.peak_rss_mib, sum(rss for *_, rss in sizes))
            total = sum(pss for _, pss, _ in sizes)
            if total > self.peak_mib:
                self.peak_mib = total
                self.at_peak = sorted(((label, pss) for label, pss, _ in sizes),
                                      key=lambda s: -s[1])


def measure(name: str, out_dir: Path) -> dict:
    path = find_notebook(name)
    start = time.perf_counter()
    with PssSampler() as sampler:
        results = run_notebook(path, out_dir / path.stem, with_solutions=True)
    wall = time.perf_counter() - start
    return {"peak_pss_mib": round(sampler.peak_mib), "wall_s": round(wall, 1),
            "missed_goals": missed_goals(path.stem, results),
            # mybinder.org installs no vLLM: GRPO_LAB_VLLM=off measures a notebook as it runs there
            "real_vllm": vllm_missing_reason() is None,
            "peak_rss_sum_mib": round(sampler.peak_rss_mib),
            "within_budget": sampler.peak_mib < BUDGET_MIB, "samples": sampler.samples,
            "processes_at_peak": [[label, round(mib)] for label, mib in sampler.at_peak]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", help="notebook numbers or stems: 07, 05b, ...")
    parser.add_argument("--output-dir", default=None,
                        help="keep the executed notebooks there (default: a temporary folder)")
    args = parser.parse_args(argv)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results.setdefault("notebooks", {})
    results["budget_mib"] = BUDGET_MIB
    results["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    measured = []
    with tempfile.TemporaryDirectory(prefix="notebook_memory_") as tmp:
        for name in args.notebooks:
            stem = find_notebook(name).stem
            results["notebooks"][stem] = row = measure(name, Path(args.output_dir or tmp))
            measured.append(row)
            verdict = "within" if row["within_budget"] else "OVER"
            print(f"{stem}: peak {row['peak_pss_mib']} MiB PSS ({verdict} {BUDGET_MIB} MiB; RSS "
                  f"summed: {row['peak_rss_sum_mib']} MiB), {row['wall_s']} s; at the peak: "
                  f"{row['processes_at_peak']}", flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return 0 if all(row["within_budget"] for row in measured) else 1


if __name__ == "__main__":
    sys.exit(main())

"""What a run of separate jobs left behind, read from outside: the trainer's progress in its
folder, each server's JSON routes and Prometheus counters, the adapters each replica holds, the
versions a vLLM replica's log says it loaded, and a figure of a preempted, resumed trainer.

Notebook 07 watches its jobs with these (the jobs themselves: grpo_lab.launch.local):

    last_step(out)                             # newest step in <out>/metrics.jsonl (0: none yet)
    replicas = replica_report(proxy_url, replica_urls)   # adapters held, /metrics counters
    loaded_versions(run_dir / "logs" / "replica-0.log")  # vLLM: every policy-vN it loaded
    plot_resume(records, killed_at=75, resumed_from="step-000070")

HTTP goes through `urllib` (one short GET each, no event loop to start in the watching process);
the servers' own client is grpo_lab.serve.client.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

VLLM_LORA_LOADED = re.compile(r"Loaded new LoRA adapter: name '([^']+)'")
"""The line a vLLM server logs for each adapter it loads at runtime (`/v1/load_lora_adapter`)."""

REPLICA_COUNTERS = ("vllm:request_success_total", "vllm:prompt_tokens_total",
                    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                    "vllm:generation_tokens_total")
"""The counters `replica_report` keeps: vLLM's names, which `grpo-lab serve` writes too (but for
`request_success`, vLLM's only)."""


def get_json(url: str, token: str | None = None, timeout_s: float = 10.0):
    """`GET url`, its JSON body decoded (an HTTP error status raises `urllib.error.HTTPError`)."""
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return json.load(reply)


def parse_counters(text: str) -> dict[str, float]:
    """Prometheus text (`GET /metrics`) -> each `*_total` counter summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def counters(url: str, token: str | None = None, timeout_s: float = 10.0) -> dict[str, float]:
    """A server's own Prometheus counters (`GET <url>/metrics`), each summed over its labels."""
    request = urllib.request.Request(url.rstrip("/") + "/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return parse_counters(reply.read().decode())


def adapters(url: str, token: str | None = None) -> list[str]:
    """The adapter names a server (or the proxy) lists in `GET /v1/models`, without the base
    model, which it lists first."""
    return [m["id"] for m in get_json(url.rstrip("/") + "/v1/models", token)["data"]][1:]


def replica_report(proxy_url: str, replica_urls: list[str]) -> dict:
    """The fleet at the end of a run: the adapters the proxy serves, those each replica holds
    (asked on its own, not through the proxy) and each replica's counters (REPLICA_COUNTERS)."""
    held = [adapters(url) for url in replica_urls]
    kept = [{k: v for k, v in counters(url).items() if k in REPLICA_COUNTERS}
            for url in replica_urls]
    return {"served": adapters(proxy_url), "held": held, "counters": kept,
            "prompt_tokens": [c.get("vllm:prompt_tokens_total", 0.0) for c in kept],
            "cache_hits": sum(c.get("vllm:prefix_cache_hits_total", 0.0) for c in kept),
            "requests": sum(c.get("vllm:request_success_total", 0.0) for c in kept)}


def last_step(folder: str | Path) -> int:
    """The newest step in a trainer's `metrics.jsonl` (0 before any; a line still being written
    is skipped)."""
    path = Path(folder) / "metrics.jsonl"
    step = 0
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            pass
    return step


def loaded_versions(log: str | Path, prefix: str = "policy-v") -> list[int]:
    """The versions a vLLM replica's log says it loaded (`VLLM_LORA_LOADED`), sorted, once each."""
    names = VLLM_LORA_LOADED.findall(Path(log).read_text(errors="replace"))
    return sorted({int(n[len(prefix):]) for n in names
                   if n.startswith(prefix) and n[len(prefix):].isdigit()})


def sampler_kl(records: list[dict]) -> dict:
    """The k3 KL of sampler against trainer over a run's steps: its mean over the steps that
    trained on stale samples (staleness > 0), its max over every step, and the largest
    |mean ratio - 1|."""
    stepped = [r for r in records if "kl" in r]
    stale = [r["kl"] for r in stepped if r.get("sample/staleness_mean", 0) > 0]
    return {"kl_stale_mean": sum(stale) / len(stale) if stale else 0.0, "stale_steps": len(stale),
            "kl_max": max((r["kl"] for r in stepped), default=0.0),
            "ratio_dev_max": max((abs(r["ratio"] - 1) for r in stepped if "ratio" in r),
                                 default=0.0)}


def resume_series(records: list[dict]) -> dict:
    """Per trained step: the adapter version it published and its samples' mean staleness."""
    stepped = [r for r in records if r.get("step", 0) > 0 and "version" in r]
    return {"step": [r["step"] for r in stepped], "version": [r["version"] for r in stepped],
            "staleness": [r.get("sample/staleness_mean", 0.0) for r in stepped]}


def plot_resume(records: list[dict], killed_at: int | None = None,
                resumed_from: str | None = None, max_staleness: int | None = None):
    """Figure: how far each step's published version is ahead of the step (left) and its
    samples' mean staleness (right), with the kill and the checkpoint the trainer resumed from.
    Before a kill, step s publishes version s. The steps from that checkpoint to the kill are
    trained twice (the metrics keep the second time), and the restarted trainer publishes the
    next unused version: the versions move ahead of the steps, so no name is ever reused."""
    import matplotlib.pyplot as plt

    data = resume_series(records)
    ahead = [v - s for s, v in zip(data["step"], data["version"])]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    left.step(data["step"], ahead, where="post", color="#0072B2", label="version - step")
    right.plot(data["step"], data["staleness"], ".", ms=4, color="#D55E00", zorder=3,
               label="samples' mean staleness")
    if max_staleness is not None:
        right.axhline(max_staleness, color="#444444", lw=0.8, ls=":", label="max_staleness")
    resumed_at = int(resumed_from.rsplit("-", 1)[1]) if resumed_from else None
    for ax in (left, right):
        if killed_at is not None:
            ax.axvline(killed_at, color="#CC79A7", lw=1.5, label=f"killed after step {killed_at}")
        if resumed_at is not None and killed_at is not None and resumed_at < killed_at:
            ax.axvspan(resumed_at, killed_at, color="#E69F00", alpha=0.3,
                       label=f"trained twice (from {resumed_from})")
        ax.set_xlabel("trainer step")
    left.legend(fontsize=8, loc="upper left")  # where neither series goes
    right.legend(fontsize=8, loc="lower right")
    left.set_ylabel("versions ahead of the step")
    left.set_ylim(min(ahead, default=0) - 0.5, max(ahead, default=0) + 1.5)
    right.set_ylabel("staleness (versions)")
    right.set_ylim(-0.1, max([*data["staleness"], max_staleness or 0, 1]) + 0.6)
    left.set_title("each step's adapter version, minus the step", fontsize=10)
    right.set_title("how stale each step's samples were", fontsize=10)
    fig.tight_layout()
    return fig

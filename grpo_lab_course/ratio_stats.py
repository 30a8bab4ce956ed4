"""The per-token ratio between the trainer and a server: how wrong weights show, and how not.

A server's completion carries the log-probability of every token it sampled; the trainer scores
the same tokens with its own weights. The per-token ratio r = pi_trainer / pi_server says whether
the two are the same policy. Its mean cannot (E_{pi_s}[pi_theta / pi_s] = 1 whatever the server
holds); its k3 (the mean of (r - 1) - log r, TRL AsyncGRPOTrainer's `kl`) and its tails can.

- `score_completions(engine, model, tokenizer, prompts, ...)`: one seeded request, its tokens
  scored by `model`: the rows, the trainer's and the server's logprobs, the mask;
- `ratio_against(...)`: the per-token ratio of that request, and its mask;
- `ratio_summary(ratio, mask)`: what a trainer could log (mean, k3, tails, largest |r - 1|);
- `mismatch_summary(...)`: one engine's tokens and logprobs against a reference engine's and the
  trainer's (notebook 05's section 4), with TRL's `sequence_mask` weights;
- `plot_ratio_histogram({label: (ratio, mask)})`: the ratios of several servings, side by side;
- `ratio_on_new_server(...)`: the same summary against a server of one's own, started with other
  flags (`logprobs_mode="raw_logprobs"`: logprobs before the temperature) and stopped again;
- notebook 05's plumbing: `nudge_lora` (a stand-in optimizer step), `show_summaries`,
  `start_vllm_engines` and `compare_engines` (section 4), `sync_summary` (the weight syncs).
"""

from __future__ import annotations

import torch

from grpo_lab.algo.logprobs import policy_logprobs
from grpo_lab.algo.sampler_correction import sampler_importance_weights, sampler_kl
from grpo_lab.train.rollout_batch import pad_left, pad_right

SUMMARY_KEYS = ("mean", "k3", "min", "q01", "q99", "max", "deviation", "tokens")


def collate_choices(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """A completions answer's `choices` as padded tensors: prompts on the left, completions and
    the server's token logprobs on the right (0 on padding), masks of 1 on real tokens."""
    p_ids, p_mask = pad_left([c["prompt_token_ids"] for c in rows], pad_id)
    c_ids, c_mask = pad_right([c["token_ids"] for c in rows], pad_id)
    served, _ = pad_right([c["logprobs"]["token_logprobs"] for c in rows], 0.0)
    return dict(p_ids=p_ids, p_mask=p_mask, c_ids=c_ids, c_mask=c_mask, served=served.float())


def score_completions(engine, model, tokenizer, prompts: list[list[int]], model_name: str, *,
                      n: int, max_tokens: int, seed: int, temperature: float,
                      ignore_eos: bool = False):
    """One seeded request on `engine` (a BlockingClient) under `model_name`, its tokens scored
    by `model` (the trainer). Returns (rows, trainer logprobs, server logprobs, mask), the last
    three (B, T) float tensors."""
    out = engine.completions(prompts, model=model_name, n=n, max_tokens=max_tokens, seed=seed,
                             temperature=temperature, ignore_eos=ignore_eos)
    rows = out["choices"]
    batch = collate_choices(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        trainer = policy_logprobs(model, batch["p_ids"], batch["p_mask"], batch["c_ids"],
                                  batch["c_mask"], temperature)
    return rows, trainer, batch["served"], batch["c_mask"].float()


def ratio_against(engine, model, tokenizer, model_name: str, prompts: list[list[int]], *,
                  seed: int = 0, temperature: float = 0.7, n: int = 32, max_tokens: int = 8):
    """exp(trainer logprob - server logprob) on every sampled token (B, T), and the mask."""
    _, trainer, served, mask = score_completions(engine, model, tokenizer, prompts, model_name,
                                                 n=n, max_tokens=max_tokens, seed=seed,
                                                 temperature=temperature)
    return torch.exp(trainer - served) * mask + (1 - mask), mask


def ratio_summary(ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The mean, k3, min, 1 % and 99 % quantiles, max and largest |r - 1| of the ratio over the
    real tokens (`mask` 1), and how many there were."""
    real = mask.bool()
    r = ratio[real].double()  # (N,) real tokens only
    log_ratio = torch.where(real, ratio, torch.ones_like(ratio)).log()  # (B, T), 0 on padding
    # k3 = mean of (r - 1) - log r: sampler_kl(log pi_theta, log pi_s) with log pi_s = 0 here
    return {"mean": r.mean().item(), "k3": sampler_kl(log_ratio, torch.zeros_like(ratio), mask),
            "min": r.min().item(), "q01": r.quantile(0.01).item(),
            "q99": r.quantile(0.99).item(), "max": r.max().item(),
            "deviation": (r - 1).abs().max().item(), "tokens": r.numel()}


def ratio_on_new_server(model, tokenizer, adapter_path, adapter_name: str,
                        prompts: list[list[int]], *, seed: int = 0, temperature: float = 0.7,
                        **flags) -> dict[str, float]:
    """Start `grpo-lab serve tiny --enable-lora` with `flags` (e.g. `logprobs_mode=...`), load the
    adapter folder `adapter_path` as `adapter_name`, and return `ratio_summary` of `model`
    against it; the server is stopped before this returns."""
    from grpo_lab.serve.client import BlockingClient
    from grpo_lab.serve.process import start_server_process

    server = start_server_process("tiny", **{"enable_lora": True, "max_lora_rank": 8, **flags})
    try:
        engine = BlockingClient(server.url)
        engine.load_lora_adapter(adapter_name, str(adapter_path))
        summary = ratio_summary(*ratio_against(engine, model, tokenizer, adapter_name, prompts,
                                               seed=seed, temperature=temperature))
        engine.close()
        return summary
    finally:
        server.stop()


def show_summary(label: str, s: dict) -> None:
    """One line per summary: the numbers a trainer could log about the ratio."""
    print(f"{label}: {s['tokens']} tokens, ratio mean {s['mean']:.4f} | k3 {s['k3']:.1e} | "
          f"min {s['min']:.3f}, 1% {s['q01']:.3f}, 99% {s['q99']:.3f}, max {s['max']:.3f}")


def mismatch_summary(rows: list[dict], trainer: torch.Tensor, served: torch.Tensor,
                     mask: torch.Tensor, reference_rows: list[dict]) -> dict[str, float]:
    """One engine's sample against the trainer and a reference engine's sample of the same
    seeded request: the share of identical completions, the per-token |log-prob difference|
    (max, mean), the sequence ratios' range, k3, and TRL's `sequence_mask` weights (cap 3):
    the share masked and the largest |w - 1|."""
    diff = (trainer - served) * mask  # log pi_trainer - log pi_sampler, 0 on padding
    ratio = diff.sum(-1).exp()  # (B,) one weight per sequence, before the cap
    weights = sampler_importance_weights(trainer, served, mask, "sequence_mask", clip_max=3.0)
    same = [a["token_ids"] == b["token_ids"] for a, b in zip(rows, reference_rows, strict=True)]
    return {"same_tokens": sum(same) / len(same),
            "max_diff": diff.abs().max().item(),
            "mean_diff": (diff.abs().sum() / mask.sum()).item(),
            "ratio_min": ratio.min().item(), "ratio_max": ratio.max().item(),
            "kl": sampler_kl(trainer, served, mask), "masked": (weights == 0).float().mean().item(),
            "weight_deviation": (weights - 1).abs().max().item()}


def same_api(rows: list[dict], reference_rows: list[dict]) -> bool:
    """Whether an engine's answer carries every field a client reads from the reference's, the
    same logprobs fields and the same prompts."""
    return (set(reference_rows[0]) <= set(rows[0])
            and set(reference_rows[0]["logprobs"]) == set(rows[0]["logprobs"])
            and [r["prompt_token_ids"] for r in rows]
            == [r["prompt_token_ids"] for r in reference_rows])


def ratio_histogram_data(ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The ratios a histogram draws: the real tokens', flattened (float64)."""
    return ratio[mask.bool()].double()


def plot_ratio_histogram(servings: dict[str, tuple[torch.Tensor, torch.Tensor]], bins: int = 60):
    """The per-token ratio of each serving (label -> (ratio, mask)) as histograms on a log x
    axis, each mean marked by a dashed line. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt
    import numpy as np

    data = {label: ratio_histogram_data(*pair).numpy() for label, pair in servings.items()}
    low = min(min(d.min() for d in data.values()), 0.98)
    high = max(max(d.max() for d in data.values()), 1.02)
    edges = np.geomspace(low, high, bins + 1)
    colours = ("#009E73", "#D55E00", "#0072B2", "#CC79A7")  # Okabe-Ito
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for (label, values), colour in zip(data.items(), colours):
        ax.hist(values, bins=edges, histtype="stepfilled", alpha=0.45, color=colour,
                edgecolor=colour, label=f"{label} (mean {values.mean():.4f})")
        ax.axvline(values.mean(), color=colour, linestyle="--", linewidth=1.2)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="per-token ratio  pi_trainer / pi_server  (log scale)",
           ylabel="tokens (log scale)", title="one request's sampled tokens, scored by the trainer")
    ax.legend(fontsize=9)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


def nudge_lora(model, generator: torch.Generator, scale: float = 0.1) -> None:
    """Stand-in for an optimizer step: move every LoRA weight of `model` by scale x N(0, 1)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn(param.shape, generator=generator) * scale)


def show_summaries(servings: dict[str, tuple[torch.Tensor, torch.Tensor]],
                   suffix: str = "") -> dict[str, dict[str, float]]:
    """`ratio_summary` of each serving (label -> (ratio, mask)), each shown on one line."""
    summaries = {label: ratio_summary(*pair) for label, pair in servings.items()}
    for label, summary in summaries.items():
        show_summary(label + suffix, summary)
    return summaries


def start_vllm_engines(stand_in, dtypes: list[str], model: str = "tiny", **flags):
    """Real vLLM servers of `model` beside the stand-in's client `stand_in`, one per dtype,
    started side by side (each start mostly waits) with `flags`. Returns (why vLLM cannot run
    here or None, {"grpo-lab serve": stand_in, "vLLM <dtype>": client, ...}, stop): `stop()`
    closes the vLLM clients and stops their servers. Where vLLM cannot run, says so."""
    from concurrent.futures import ThreadPoolExecutor

    from grpo_lab.serve.client import BlockingClient
    from grpo_lab.serve.process import start_vllm_process, vllm_missing_reason

    missing, servers = vllm_missing_reason(), {}
    if missing:
        print(missing, "-> section 4 compares the stand-in with the trainer only")
    elif dtypes:
        with ThreadPoolExecutor(len(dtypes)) as pool:
            starts = pool.map(lambda d: start_vllm_process(model, dtype=d, **flags), dtypes)
            servers = dict(zip(dtypes, starts, strict=True))
    clients = {f"vLLM {dtype}": BlockingClient(s.url) for dtype, s in servers.items()}

    def stop():
        for client, server in zip(clients.values(), servers.values(), strict=True):
            client.close()
            server.stop()

    return missing, {"grpo-lab serve": stand_in, **clients}, stop


def compare_engines(engines: dict, model, tokenizer, prompts: list[list[int]], name: str,
                    path, **sample) -> tuple[dict[str, dict[str, float]], bool]:
    """Load the adapter folder `path` as `name` on every engine (label -> BlockingClient), sample
    the same seeded request from each (`score_completions` with `sample`), unload it. Returns
    (`mismatch_summary` of each against the first engine, whether every engine gives the first's
    API fields and the same load and unload answers), each printed."""
    loaded = {k: e.load_lora_adapter(name, str(path)) for k, e in engines.items()}
    sampled = {k: score_completions(e, model, tokenizer, prompts, name, **sample)
               for k, e in engines.items()}
    unloaded = {k: e.unload_lora_adapter(name) for k, e in engines.items()}
    first = next(iter(engines))
    reference = sampled[first][0]
    mismatch = {k: mismatch_summary(*s, reference) for k, s in sampled.items()}
    matches = all(same_api(sampled[k][0], reference)
                  and (loaded[k], unloaded[k]) == (loaded[first], unloaded[first]) for k in engines)
    for k, m in mismatch.items():
        print(f"{k:>15}:", "  ".join(f"{key} {value:.3g}" for key, value in m.items()))
    print("same API and adapter answers on every engine:", matches)
    return mismatch, matches


def sync_summary(syncs: list[dict]) -> float:
    """Print the weight syncs' p50 and max seconds, bytes and the last one's stages; return the
    p50 in seconds."""
    sync_s = sorted(s["sync_s"] for s in syncs)
    print(f"{len(sync_s)} weight syncs: p50 {sync_s[len(sync_s) // 2] * 1000:.0f} ms, max "
          f"{sync_s[-1] * 1000:.0f} ms, {syncs[-1]['bytes']:,} bytes each; stages of the last:",
          {k: round(v, 4) for k, v in syncs[-1].items() if k.endswith("_s")})
    return sync_s[len(sync_s) // 2]

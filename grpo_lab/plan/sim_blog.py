"""The blog's five runs as data, and the simulator's stage costs calibrated from its run 1 only.

`BLOG_RUNS` holds the published figures (the Hugging Face blog post "Async GRPO with LoRA across
HF Jobs", huggingface.co/blog/asyncgrpo-lora-hfjobs, as docs/recipe.md's tables give them);
`blog_setting(run)` is run 1's settings and what each later run changed; `blog_costs()` derives
every stage cost from run 1's figures, the model's shape and public H200 figures, so runs 2-5
are predictions (benchmarks/simulator_vs_blog.py). `costs_for` carries the calibrated
efficiencies to another model size or GPU.

Run 1 is trainer-bound (a full queue, no wait): its step time says nothing of how fast the
replicas could generate. Their cost comes from a decode roofline of the H200 (weights and KV
cache read at a share of the HBM bandwidth, matmuls at the peak) slowed by the share of a step
vLLM keeps its GPU busy; run 1 only bounds it from below (4.6k tok/s with a full queue).
"""

from __future__ import annotations

from dataclasses import replace

from .sim_model import PipelineSetting, StageCosts

BLOG_SOURCE = ("Hugging Face blog, 'Async GRPO with LoRA across HF Jobs' "
               "(huggingface.co/blog/asyncgrpo-lora-hfjobs), as in docs/recipe.md")

BLOG_RUNS: dict[int, dict] = {
    1: dict(change="baseline, 2 replicas", step_s_p50=22.9, fwd_bwd_s_p50=21.9, mfu=3.9,
            rollout_wait_s=0.02, queue_size=476, queue_maxsize=512,
            generation_tokens_per_s=4600, micro_batches=64, samples_per_row=1,
            weight_sync_s_p50=8.5, staleness_mean=1.5, wall_clock_s=3 * 3600 + 27 * 60,
            bottleneck="trainer"),
    2: dict(change="token budget 16,384 (packing)", step_s_p50=5.9, fwd_bwd_s_p50=5.6, mfu=19.0,
            samples_per_row=12.7, micro_batches=6, row_fill_frac=0.95,
            generation_tokens_per_s=(25000 + 27500) / 2),
    3: dict(change="gradient checkpointing off", fwd_bwd_s_p50=4.6, mfu=23.0,
            queue_size=(60 + 71) / 2, rollout_wait_s=0.6, weight_sync_s_p50=7.6,
            weight_sync_share=0.25, bottleneck="generation"),
    4: dict(change="a third replica", fwd_bwd_s_p50=4.6, weight_sync_s_p50=5.8,
            generation_tokens_per_s=26000, inflight=128, bottleneck="client_cap"),
    5: dict(change="in-flight cap 384", step_s_p50=4.8, fwd_bwd_s_p50=4.6, mfu=23.5,
            queue_size=690, queue_maxsize=768, backpressure_s=5.0, rollout_wait_s=0.03,
            staleness_mean=2.0, wall_clock_s=53 * 60, weight_sync_s_p50=6.2),
}
"""The published figures of runs 1-5 (source: BLOG_SOURCE). Ranges ("25-27.5k tok/s", "queue
about 60-71") are kept as their midpoints; seconds are p50s, MFU in percent."""

# Qwen/Qwen2.5-Math-1.5B's config.json (grpo_lab.model.shaped_models.QWEN25_MATH_15B)
BLOG_MODEL = dict(params=1_543_714_304, hidden=1536, layers=28, heads=12, kv_heads=2,
                  head_dim=128, ffn=8960, vocab=151_936)
H200 = dict(peak_flops=989e12, memory_bandwidth=4.8e12, memory_bytes=141e9)
"""NVIDIA's H200 SXM data sheet: 1,979 TFLOPS bf16 with sparsity (989 dense), 4.8 TB/s, 141 GB."""

HBM_EFFICIENCY = 0.7
"""Assumed: the share of the HBM bandwidth decode kernels reach (weights and KV reads)."""
GPU_BUSY_SHARE = 0.38
"""vLLM's blog "vLLM v0.6.0: 2.7x throughput improvement" (Sept 2024): in v0.5.3 the GPU was
busy 38 % of a decode step serving Llama 3 8B on an H100; the rest was the CPU's scheduling,
input preparation and API server. Small models fare no better: their GPU part is shorter."""
TRAIN_EFFICIENCY = 0.35
"""Assumed (not from runs 2-5): the share of the dense bf16 peak a long row's forward and
backward reaches, TRL's FLOP count; public reports give 40-50 % for 7-8 B full fine-tuning on
H100s (torchtitan), a 1.5 B model's narrow matmuls and rank-1 LoRA's memory-bound ops less."""
BACKWARD_OVER_FORWARD = 2.0
"""The backward's cost over the forward's (TRL's 3 x count): gradient checkpointing recomputes
the forward, (1 + 1 + 2) / (1 + 2) = 4/3 the time."""


def decoder_flops(model: dict = BLOG_MODEL) -> tuple[float, float]:
    """TRL's training FLOPs per token of a dense decoder (grpo_lab.watch.flops' count): the part
    at zero context, and what each token of sequence length adds (the attention scores)."""
    h, L, heads, kv, d = (model[k] for k in ("hidden", "layers", "heads", "kv_heads", "head_dim"))
    linear = 2 * h * (heads + 2 * kv) * d + 2 * heads * d * h + 2 * 3 * h * model["ffn"]
    return 3 * (L * linear + 2 * model["vocab"] * h), 3 * L * 4 * heads * d


def blog_lengths() -> tuple[float, float]:
    """(mean prompt, mean completion) tokens from run 1: its generation, 4.6k tok/s with the
    buffer full, is what the trainer consumed per wall second (syncs included); its MFU gives
    the tokens forwarded per step (TRL's count, 2 H200s), their sum."""
    run = BLOG_RUNS[1]
    samples = 128
    completion = run["generation_tokens_per_s"] * run["wall_clock_s"] / 500 / samples
    flops = run["mfu"] / 100 * 2 * H200["peak_flops"] * run["fwd_bwd_s_p50"]
    base, per_ctx = decoder_flops()
    sample = 1000.0
    for _ in range(50):  # tokens x flops(tokens per sample) = flops: a fixed point
        sample = flops / samples / (base + per_ctx * sample)
    return sample - completion, completion


def blog_setting(run: int = 1) -> PipelineSetting:
    """Run 1's settings (docs/recipe.md, "The numbers"), then each later run's one change."""
    if run not in BLOG_RUNS:
        raise ValueError(f"the blog has runs 1-5 (got {run})")
    prompt, completion = blog_lengths()
    setting = PipelineSetting(replicas=2, max_inflight=128, prompts_per_step=16,
                              num_generations=8, max_staleness=4, buffer_size=64,
                              token_budget=None, micro_batch_size=1, gradient_checkpointing=True,
                              weight_sync_steps=4, steps=500, prompt_tokens=round(prompt),
                              max_completion_tokens=3000, completion_tokens=completion,
                              request_shape="single", worker="stream")
    changes = {2: dict(token_budget=16384), 3: dict(gradient_checkpointing=False),
               4: dict(replicas=3),
               5: dict(max_inflight=384, buffer_size=96)}  # its queue's published max: 768
    for k in range(2, run + 1):
        setting = replace(setting, **changes[k])
    return setting


def blog_costs() -> StageCosts:
    """Stage costs from run 1's figures only, the model's shape and the H200's data sheet."""
    m, run = BLOG_MODEL, BLOG_RUNS[1]
    prompt, completion = blog_lengths()
    sample = prompt + completion
    base, per_ctx = decoder_flops()
    train_flops = base + per_ctx * sample
    bandwidth = H200["memory_bandwidth"] * HBM_EFFICIENCY
    kv_bytes = 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * 2  # K and V, bf16
    forward = (base + per_ctx * sample) / 3  # one token's forward FLOPs
    # trainer: 64 one-sample micro-batches per process with gradient checkpointing
    gc = (2 + BACKWARD_OVER_FORWARD) / (1 + BACKWARD_OVER_FORWARD)
    token_s = train_flops / (H200["peak_flops"] * TRAIN_EFFICIENCY)
    passes = run["micro_batches"]
    micro_batch_s = (run["fwd_bwd_s_p50"] / gc - passes * sample * token_s) / passes
    outside = run["step_s_p50"] - run["fwd_bwd_s_p50"] - run["rollout_wait_s"]
    return StageCosts(
        decode_step_s=2 * m["params"] / bandwidth / GPU_BUSY_SHARE,
        decode_seq_s=2 * m["params"] / H200["peak_flops"] / GPU_BUSY_SHARE,
        decode_ctx_s=kv_bytes / bandwidth / GPU_BUSY_SHARE,
        prefill_token_s=forward / (H200["peak_flops"] * TRAIN_EFFICIENCY),
        train_token_s=token_s, train_micro_batch_s=micro_batch_s,
        step_micro_batch_s=outside / passes, checkpointing_factor=gc,
        sync_pause_s=0.3, sync_save_s=1.1, sync_load_s=3.0, sync_other_s=0.1,
        mount_lag_s=(1.95, 4.0), load_retry_s=2.0,  # 246 of 252 loads on the 3rd try, 6 on 2nd
        train_flops_per_token=base, train_flops_per_token_ctx=per_ctx,
        trainer_peak_flops=H200["peak_flops"], trainer_gpus=2,
        source=f"run 1 of {BLOG_SOURCE}; H200 data sheet; priors HBM_EFFICIENCY, "
               "GPU_BUSY_SHARE, TRAIN_EFFICIENCY (grpo_lab.plan.sim_blog)")


def costs_for(*, model_params: int, trainer_gpus: int, trainer_peak_flops: float,
              replica_memory_bandwidth: float, replica_peak_flops: float,
              sync_s: float | None = None, mount_lag_s: float | None = None,
              base: StageCosts | None = None) -> StageCosts:
    """`base`'s (default blog_costs()) efficiencies carried to another model and GPUs: what
    reads the weights or KV cache scales with parameters over bandwidth, what computes with
    parameters over peak FLOP/s; fixed overheads (a micro-batch's launches, the engine's step,
    the sync's stages) stay. `sync_s`: a measured whole sync, replacing base's pause + save +
    mount lag + load. `mount_lag_s`: a measured lag from a write in one job to its visibility in
    another's mount (a preflight's `sync_lag_s`), replacing base's range (the blog's 2-4 s): the
    replicas' load retries follow it."""
    base = base or blog_costs()
    size = model_params / BLOG_MODEL["params"]
    read = size * H200["memory_bandwidth"] / replica_memory_bandwidth
    compute = size * H200["peak_flops"] / replica_peak_flops
    train = size * (base.trainer_peak_flops or H200["peak_flops"]) / trainer_peak_flops
    costs = replace(
        base, decode_step_s=base.decode_step_s * read, decode_ctx_s=base.decode_ctx_s * read,
        decode_seq_s=base.decode_seq_s * compute, prefill_token_s=base.prefill_token_s * compute,
        train_token_s=base.train_token_s * train,
        train_flops_per_token=base.train_flops_per_token * size,
        train_flops_per_token_ctx=base.train_flops_per_token_ctx * size ** 0.5,
        trainer_peak_flops=trainer_peak_flops, trainer_gpus=trainer_gpus,
        source=f"{base.source}; carried to {model_params:,} parameters")
    if sync_s is not None:
        fixed = costs.sync_pause_s + costs.sync_save_s + costs.sync_other_s
        costs = replace(costs, mount_lag_s=(0.0, 0.0), sync_load_s=max(0.0, sync_s - fixed))
    elif mount_lag_s is not None:
        if mount_lag_s < 0:
            raise ValueError(f"mount_lag_s must be >= 0 seconds, got {mount_lag_s}")
        costs = replace(costs, mount_lag_s=(mount_lag_s, mount_lag_s))
    return costs

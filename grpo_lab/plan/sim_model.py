"""What the pipeline simulator (grpo_lab.plan.simulator) is told: a run's settings, its costs.

`PipelineSetting` is what a run chooses (replicas, the client's in-flight cap, the buffer, the
trainer's micro-batches, the sync interval, the lengths of its samples); `StageCosts` is what the
hardware and the model make each stage cost. The functions below turn the two into the times the
simulator adds up: a replica's decode step (a roofline: a fixed part, the weights read once per
step, plus a part per sequence, its compute and its KV cache read), a prefill, a trainer step
from the micro-batches it forwards, and a weight sync (pause, save, the mount's lag rounded up to
the load's retries, load, resume). Standard library only.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineSetting:
    """One run's choices. Lengths in tokens; buffer in groups (one prompt's G completions)."""

    replicas: int = 2
    max_inflight: int | None = 128
    """The client's cap on requests in flight (None: no cap)."""
    prompts_per_step: int = 16
    num_generations: int = 8
    max_staleness: int = 4
    buffer_size: int = 64
    token_budget: int | None = None
    """Forward tokens per micro-batch; None: `micro_batch_size` samples per micro-batch."""
    micro_batch_size: int = 2
    """Samples per micro-batch (and process) without a token budget, padded to the longest."""
    gradient_checkpointing: bool = True
    weight_sync_steps: int = 4
    steps: int = 500
    prompt_tokens: int = 440
    """Mean prompt length (lognormal, `prompt_sigma`, at most `max_prompt_tokens`)."""
    max_completion_tokens: int = 3000
    completion_tokens: float = 890.0
    """Mean completion length after the cut at `max_completion_tokens`: completions are drawn
    from a lognormal of log-sd `completion_sigma` (reasoning lengths are right-skewed), those
    over the cap are cut there (the clipped ones)."""
    completion_sigma: float = 0.75
    prompt_sigma: float = 0.3
    max_prompt_tokens: int = 1096
    packing: bool = True
    """With a token budget: pack samples into padding-free rows of `token_budget` (TRL's, one
    row per micro-batch); False: grpo_lab's padded micro-batches (longest first)."""
    shared_prompt: bool = False
    """grpo_lab's `shared_prompt` layout: a row per group, its prompt forwarded once, then its G
    completions (grpo_lab.algo.shared_prompt); False: a row per sample (TRL's)."""
    request_shape: str = "single"
    """"single": G requests of n = 1 per prompt (TRL's); "group": one request of n = G."""
    worker: str = "stream"
    """"stream": TRL's rollout worker, requests sent as the cap frees a slot, groups scored and
    queued as they finish; "batch": grpo_lab's, one step's prompts per generate call, admitted
    when the policy is recent enough (batch j waits for version j // weight_sync_steps -
    max_staleness)."""
    proxy: bool | None = None
    """A proxy in front of the replicas (None: when there are 2+ replicas); it only matters
    with `StageCosts.cores`: it is a busy process while requests are in flight."""


@dataclass(frozen=True)
class StageCosts:
    """What each stage costs, in seconds. Replica times are for one replica."""

    decode_step_s: float
    """A decode step's part that does not grow with the batch: the weights read once, the
    engine's step overhead."""
    decode_seq_s: float
    """What each sequence in the batch adds to a decode step (its matmuls, sampling)."""
    decode_ctx_s: float
    """What each token of a sequence's context adds to a decode step (its KV cache read)."""
    prefill_token_s: float
    """Replica seconds per prompt token prefilled (decoding stalls meanwhile)."""
    train_token_s: float
    """Trainer seconds per forwarded token, forward and backward, no gradient checkpointing."""
    train_micro_batch_s: float
    """Fixed seconds of a micro-batch's forward and backward (kernel launches, FSDP gathers)."""
    step_micro_batch_s: float = 0.0
    """Seconds per micro-batch outside forward and backward (collation, moving the batch)."""
    optimizer_s: float = 0.0
    checkpointing_factor: float = 4 / 3
    """fwd+bwd time with gradient checkpointing over without: backward recomputes the forward;
    with backward = 2 x forward, (1 + 1 + 2) / (1 + 2)."""
    score_group_s: float = 0.0
    """Seconds to score one group (serial, on the rollout worker)."""
    prefix_tail_tokens: int = 8
    """Tokens of a prompt prefilled again by each later completion of its group on the same
    replica (the prefix cache holds the rest: the tail after the last full block)."""
    max_num_seqs: int = 256
    """Sequences a replica decodes at once (vLLM's default); more wait in its queue."""
    sync_pause_s: float = 0.3
    sync_save_s: float = 1.1
    sync_load_s: float = 3.0
    """Seconds of one replica's load once the adapter is visible in its mount."""
    sync_other_s: float = 0.1
    mount_lag_s: tuple[float, float] = (1.95, 4.0)
    """Range (uniform) of the lag from the save to the adapter's visibility in a replica's
    mount; the load is retried every `load_retry_s` until it is there."""
    load_retry_s: float = 2.0
    train_flops_per_token: float = 0.0
    """TRL's count (3 x the forward's matmuls, grpo_lab.watch.flops) at zero context, for MFU."""
    train_flops_per_token_ctx: float = 0.0
    """What each token of mean sequence length adds to it (the attention scores)."""
    trainer_peak_flops: float = 0.0
    """Peak FLOP/s of one trainer process (0: no MFU)."""
    trainer_gpus: int = 1
    """Trainer processes (FSDP, one a GPU): each forwards its share of the step's samples."""
    cores: float | None = None
    """Cores the trainer, the replicas and the proxy share (a CPU machine), each busy one a
    single thread: when more are busy than there are cores, each runs at cores / busy of its
    speed (grpo_lab.plan.simulator). What they share in effect, as measured (two busy
    processes slowing each other 2x: 1 core). None: each has its own device (GPUs)."""
    source: str = ""
    """Where the figures come from."""


def lognormal_mu(mean: float, sigma: float, cap: int) -> float:
    """The lognormal's mu whose draws, cut at `cap`, have mean `mean` (bisection)."""
    def clipped_mean(mu: float) -> float:
        # E[min(X, cap)] for X ~ LogNormal(mu, sigma)
        z = (math.log(cap) - mu) / sigma
        phi = 0.5 * (1 + math.erf((z - sigma) / math.sqrt(2)))
        tail = 0.5 * math.erfc(z / math.sqrt(2))
        return math.exp(mu + sigma ** 2 / 2) * phi + cap * tail

    if mean >= cap:
        return math.log(cap) + 10 * sigma
    lo, hi = -5.0, math.log(cap) + 10 * sigma
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if clipped_mean(mid) < mean else (lo, mid)
    return (lo + hi) / 2


class LengthSampler:
    """Prompt and completion lengths of a setting, drawn from its seeded generator."""

    def __init__(self, setting: PipelineSetting, rng: random.Random):
        s = setting
        self.rng, self.s = rng, s
        self.mu_c = lognormal_mu(s.completion_tokens, s.completion_sigma, s.max_completion_tokens)
        self.mu_p = math.log(max(s.prompt_tokens, 1)) - s.prompt_sigma ** 2 / 2

    def prompt(self) -> int:
        n = round(self.rng.lognormvariate(self.mu_p, self.s.prompt_sigma))
        return max(1, min(self.s.max_prompt_tokens, n))

    def completion(self) -> int:
        n = round(self.rng.lognormvariate(self.mu_c, self.s.completion_sigma))
        return max(1, min(self.s.max_completion_tokens, n))


def decode_step_s(costs: StageCosts, batch: int, context_tokens: float) -> float:
    """One decode step of a replica with `batch` sequences holding `context_tokens` in all."""
    return costs.decode_step_s + batch * costs.decode_seq_s + context_tokens * costs.decode_ctx_s


def micro_batches(samples: list[tuple[int, int]], setting: PipelineSetting) -> list[dict]:
    """One process's micro-batches of (prompt, completion) lengths: each {samples, tokens
    (forwarded, padding included), real (unpadded)}."""
    s = setting
    lengths = [p + c for p, c in samples]
    if s.token_budget is None:  # fixed samples per micro-batch, padded to the longest
        out = []
        for k in range(0, len(samples), s.micro_batch_size):
            part = samples[k:k + s.micro_batch_size]
            width = max(p for p, _ in part) + max(c for _, c in part)
            out.append(dict(samples=len(part), tokens=len(part) * width,
                            real=sum(p + c for p, c in part)))
        return out
    if s.packing:  # first-fit decreasing into padding-free rows of token_budget, one a pass
        rows: list[list[int]] = []
        for n in sorted(lengths, reverse=True):
            row = next((r for r in rows if sum(r) + n <= s.token_budget), None)
            rows.append([n]) if row is None else row.append(n)
        return [dict(samples=len(r), tokens=sum(r), real=sum(r)) for r in rows]
    # grpo_lab's padded plan: longest first, grown while rows x widest fits the budget
    order = sorted(samples, key=lambda pc: -(pc[0] + pc[1]))
    out, part = [], []
    for item in order + [None]:
        trial = part + [item] if item else part
        width = max(p for p, _ in trial) + max(c for _, c in trial) if trial else 0
        if item is None or (part and len(trial) * width > s.token_budget):
            pw = max(p for p, _ in part) + max(c for _, c in part)
            out.append(dict(samples=len(part), tokens=len(part) * pw,
                            real=sum(p + c for p, c in part)))
            part = []
        if item:
            part.append(item)
    return out


def fwd_bwd_s(costs: StageCosts, setting: PipelineSetting, batches: list[dict]) -> float:
    """Forward and backward seconds of one process's micro-batches."""
    work = sum(costs.train_micro_batch_s + mb["tokens"] * costs.train_token_s for mb in batches)
    return work * (costs.checkpointing_factor if setting.gradient_checkpointing else 1.0)


def sync_s(costs: StageCosts, replicas: int, rng: random.Random) -> tuple[float, int]:
    """One weight sync's seconds and the load attempts of its slowest replica: pause, save,
    then every replica retries its load until the adapter shows in its mount, then loads."""
    attempts = max(1 + math.ceil(max(0.0, rng.uniform(*costs.mount_lag_s)) / costs.load_retry_s
                                 - 1e-9) for _ in range(replicas))
    accept = (attempts - 1) * costs.load_retry_s + costs.sync_load_s
    return costs.sync_pause_s + costs.sync_save_s + accept + costs.sync_other_s, attempts


def train_flops(costs: StageCosts, tokens: int, sequences: int) -> float:
    """TRL's model FLOPs of a step's forward and backward over `tokens` unpadded tokens."""
    mean_len = tokens / max(sequences, 1)
    return tokens * (costs.train_flops_per_token + costs.train_flops_per_token_ctx * mean_len)

"""Benchmark the adapter weight sync through a bucket, and what a rank-1 adapter weighs.

    python benchmarks/adapter_sync.py            # 20 syncs against a real server process
    python benchmarks/adapter_sync.py --syncs 5

Each sync is `HTTPGenerator.publish`: write the adapter to the bucket (hidden temp dir, chmod,
atomic rename), pause the server (keep), load the new version, resume, unload the oldest. The
server runs as its own process (one torch thread) and keeps serving a light stream of requests
during the syncs, as it would in training. Reported: p50/p95 of publish + load and of the whole
sync, and bytes per sync.

Then the size argument of the recipe, for Qwen2.5-1.5B (the blog's model), computed without a
download: its published dimensions in a `Qwen2Config`, the model built on the meta device (no
memory), its parameters counted, and a rank-1 all-linear LoRA counted from the shapes of its
linear layers (r * (in + out) each, lm_head excluded as PEFT's "all-linear" does).
Goals: publish + load p50 <= 0.2 s; rank-1 adapter <= 1 % of the full weights.
Results go to benchmarks/results/adapter_sync.json and are printed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from grpo_lab.bucket.adapters import AdapterBucket  # noqa: E402
from grpo_lab.model.models import load_model_and_tokenizer  # noqa: E402
from grpo_lab.model.tiny_model import tiny_model_path  # noqa: E402
from grpo_lab.rollout.http_generator import HTTPGenerator  # noqa: E402
from grpo_lab.serve.process import start_server_process  # noqa: E402

GOALS = {"publish_load_p50_s": 0.2, "rank1_fraction_pct": 1.0}

# Qwen2.5-1.5B's config.json on the Hub (dimensions only; weights are stored in bfloat16).
QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                  max_position_embeddings=131072, tie_word_embeddings=True,
                  rope_theta=1000000.0, rms_norm_eps=1e-6)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def qwen_adapter_fraction(rank: int = 1) -> dict:
    """Full weights vs a rank-`rank` all-linear LoRA of Qwen2.5-1.5B, from shapes only."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**QWEN25_15B)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    output = model.get_output_embeddings()
    lora = sum(rank * (m.in_features + m.out_features) for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m is not output)
    full_bytes, adapter_bytes = 2 * params, 4 * lora  # bf16 weights; PEFT saves LoRA in fp32
    return {"model_parameters": params, "full_bytes_bf16": full_bytes,
            "lora_rank": rank, "lora_parameters": lora, "adapter_bytes_fp32": adapter_bytes,
            "rank1_fraction_pct": round(100 * adapter_bytes / full_bytes, 4)}


def run_syncs(syncs: int, rank: int, max_staleness: int) -> dict:
    from peft import LoraConfig, get_peft_model

    base, tokenizer = load_model_and_tokenizer(tiny_model_path(progress=False))
    model = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM"))
    prompt = tokenizer("12+34=")["input_ids"]
    with tempfile.TemporaryDirectory() as tmp, start_server_process(
            "tiny", enable_lora=True, max_lora_rank=max(8, rank), max_loras=max_staleness + 2,
            logprobs_mode="processed_logprobs") as server:
        generator = HTTPGenerator(server.url, AdapterBucket(Path(tmp), max_staleness=max_staleness),
                                  max_staleness=max_staleness)
        stop = threading.Event()

        def traffic():  # rollouts keep flowing under the newest version
            while not stop.is_set():
                generator.generate([prompt], version=generator.latest_version,
                                   num_generations=4, max_new_tokens=6, temperature=1.0)

        generator.publish(model, 0)
        thread = threading.Thread(target=traffic, daemon=True)
        thread.start()
        try:
            for version in range(1, syncs + 1):
                with torch.no_grad():  # an optimizer step's worth of change
                    for name, param in model.named_parameters():
                        if "lora_" in name:
                            param.add_(torch.randn_like(param) * 1e-3)
                generator.publish(model, version)
        finally:
            stop.set()
            thread.join(30)
            generator.close()
    timed = generator.syncs[1:]  # the first publish has no traffic and loads into an idle server
    publish_load = [s["publish_s"] + s["load_s"] for s in timed]
    whole = [s["sync_s"] for s in timed]
    return {
        "syncs": len(timed), "lora_rank": rank, "max_staleness": max_staleness,
        "publish_load_p50_s": round(statistics.median(publish_load), 4),
        "publish_load_p95_s": round(percentile(publish_load, 95), 4),
        "sync_p50_s": round(statistics.median(whole), 4),
        "sync_p95_s": round(percentile(whole, 95), 4),
        "publish_p50_s": round(statistics.median(s["publish_s"] for s in timed), 4),
        "load_p50_s": round(statistics.median(s["load_s"] for s in timed), 4),
        "bytes_per_sync": timed[-1]["bytes"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--syncs", type=int, default=20)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--max-staleness", type=int, default=4, help="the recipe's 4")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "adapter_sync.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sync = run_syncs(args.syncs, args.rank, args.max_staleness)
    size = qwen_adapter_fraction(1)
    results = {"goals": GOALS, "tiny_model_sync": sync, "qwen2.5_1.5b": size}
    results["goals_met"] = (sync["publish_load_p50_s"] <= GOALS["publish_load_p50_s"]
                            and size["rank1_fraction_pct"] <= GOALS["rank1_fraction_pct"])
    print(f"{sync['syncs']} syncs of a rank-{args.rank} adapter ({sync['bytes_per_sync']:,} bytes "
          f"each), max_staleness {args.max_staleness}:")
    print(f"  publish + load  p50 {sync['publish_load_p50_s']:.3f} s  p95 "
          f"{sync['publish_load_p95_s']:.3f} s   (goal p50 <= {GOALS['publish_load_p50_s']} s)")
    print(f"  whole sync      p50 {sync['sync_p50_s']:.3f} s  p95 {sync['sync_p95_s']:.3f} s "
          "(publish, pause, load, resume, unload)")
    print(f"Qwen2.5-1.5B: {size['model_parameters']:,} parameters = "
          f"{size['full_bytes_bf16'] / 1e9:.2f} GB in bf16; rank-1 LoRA "
          f"{size['lora_parameters']:,} parameters = {size['adapter_bytes_fp32'] / 1e6:.2f} MB "
          f"= {size['rank1_fraction_pct']:.3f} % (goal <= {GOALS['rank1_fraction_pct']} %)")
    print("goals met:", results["goals_met"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if results["goals_met"] else 1


if __name__ == "__main__":
    sys.exit(main())

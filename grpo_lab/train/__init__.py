"""Stage 2, train: synchronous GRPO, one step after the other, full or LoRA.

The trainer, token-budget micro-batches (packing), sample completions every N steps and
`metrics.jsonl` with TRL's names; several processes under `accelerate launch` (distributed).
Taught by notebooks 01, 02 (LoRA) and 03 (the same run with TRL); packing in notebook 08; on a
dataset and a chat model in notebook 09.
"""

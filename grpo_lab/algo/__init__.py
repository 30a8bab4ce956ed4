"""algo: GRPO's mathematics on tensors, with no model loading and no loop.

Group advantages, the clipped surrogate, k3 KL and the three loss aggregations (`grpo_loss`),
per-token log-probabilities at a real vocabulary (`logprobs`), the sampler's importance weights
(`sampler_correction`), token-budget micro-batches (`packing`) and each prompt forwarded once
for its group (`shared_prompt`). Taught by notebooks 01 and 01b.
"""

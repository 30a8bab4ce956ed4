"""Stage 1, core: the pieces of GRPO itself, with no training loop.

The tiny offline model and its tokenizer, tasks and rewards, sampling completions with their
logprobs, greedy evaluation, the GRPO loss (advantages, clipped surrogate, KL) and `GRPOConfig`.
Taught by notebooks 00 (the tiny model) and 01 (GRPO from scratch). The pieces that take it to
real models and data (datasets, chat prompts, weighted rewards, device and dtype, the offline
chat model) are taught by notebook 09. `processes` is the process-group toolkit (spawn, wait
until healthy, stop a group) with which the later stages start servers and jobs.
"""

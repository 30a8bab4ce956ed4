"""data: what a model is asked and how its answers are scored.

Synthetic tasks with held-out problems, tasks from dataset files, GSM8K-style word problems,
prompts rendered through a chat template, reward functions with TRL's signature and the
weighted `RewardSet`. Taught by notebooks 00, 01 and 09.
"""

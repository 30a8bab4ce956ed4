"""Stage 7, jobs: the recipe's processes written down as data, then run.

Job specs (`JobSpec`, `RunPlan`), the recipe's plan, the local launcher (process groups,
health waits) and Hugging Face Jobs; the two trainer jobs (`train-async` with grpo_lab's
trainer, `train-trl-async` with TRL's). Taught by notebook 07.
"""

"""launch: the recipe's processes written down as data, then started.

Job specs (`JobSpec`, `RunPlan`), the recipe's plan and its settings, the replicas' and the
trainer's commands, the local launcher, Hugging Face Jobs (submit, follow, cancel), how a job
installs grpo_lab, and preflight. Taught by notebook 07.
"""

"""train: the trainers, their configs and their jobs.

`GRPOConfig` and the synchronous `GRPOTrainer` (full or LoRA; its update over micro-batches in
`policy_update`), a step's batch, DAPO's dynamic sampling, several processes under `accelerate
launch`; `AsyncGRPOConfig` and `AsyncGRPOTrainer` (a rollout worker thread, admission by
staleness, the proximal policy); the trainer job `grpo-lab train-async`. Taught by notebooks 01,
02, 04 and 07.
"""

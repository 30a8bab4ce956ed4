"""train: the trainers, their configs and their jobs.

One GRPO step top to bottom in `grpo_step` (sample, score, advantages, pi_old, the
micro-batched update, the metrics), which both trainers take. `GRPOConfig` and the synchronous
`GRPOTrainer` (full or LoRA), a step's batch, DAPO's dynamic sampling, several processes under
`accelerate launch`; `AsyncGRPOConfig` and `AsyncGRPOTrainer` (a rollout worker thread,
admission by staleness, the proximal policy); the trainer job `grpo-lab train-async`. Taught by
notebooks 01, 02, 04 and 07.
"""

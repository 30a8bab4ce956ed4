"""trl: grpo_lab beside TRL, behind the `trl` extra (`pip install 'grpo_lab[trl]'`).

TRL's `AsyncGRPOTrainer` fitted to grpo_lab's settings and bucket and made to run on a CPU, its
dataset and rewards from a grpo_lab run config, its trainer job (`grpo-lab train-trl-async`),
and the run doctor as a `transformers.TrainerCallback`. Nothing outside this folder imports
TRL. Taught by notebook 03.
"""

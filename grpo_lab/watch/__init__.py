"""watch: what a run writes about itself, and reading it.

`metrics.jsonl` and its reporters (trackio, TensorBoard), the metric names with their meanings
and TRL's names (`metric_names`), the run doctor, `diagnose` (which side of the rollout buffer
waits), the pipeline plots and the live dashboard, model FLOPs utilisation. Taught by notebooks
08 and 10.
"""

"""Stage 8, observe: reading a running pipeline.

`diagnose` (which side of the rollout buffer waits), the pipeline plots, the live dashboard,
and short runs with one knob changed. Taught by notebook 08 (the dashboard also in 04 and 07).
"""

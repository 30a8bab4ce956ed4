"""Stage 7, jobs: the recipe's processes written down as data, then run.

Job specs (`JobSpec`, `RunPlan`), the recipe's plan, the local launcher (process groups,
health waits) and Hugging Face Jobs. Taught by notebook 07.
"""

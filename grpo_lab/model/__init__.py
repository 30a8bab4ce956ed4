"""model: the models a run trains and how they sample.

The shipped tiny and chat models and their builds, SmolLM2-135M-Instruct from its PyPI wheel,
random-weight models at real shapes, loading any of them by name (`models`), sampling with
per-token log-probabilities (`generation`), greedy held-out accuracy (`evaluation`) and the
memory one step holds (`memory_model`). Taught by notebooks 00, 09 and 09b.
"""

# EXERCISE 08.2
prediction = 0.8  # the step is run 1's again: generation is done early and waits the rest
knobs = dict(token_budget=16, max_inflight=None)  # run 1's token budget, run 4's generation

# EXERCISE 07.1
newest = summary["version"]
expected_on_replicas = [f"policy-v{v}" for v in range(newest - max_staleness, newest + 1)]

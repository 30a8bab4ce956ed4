"""proxy: `grpo-lab proxy`, several replicas behind one vLLM-compatible URL.

Its settings, the KV-prefix affinity router, the routing keys of a prompt, a lean HTTP pool,
all-or-nothing broadcasts of adapter loads, replica health, the completion routes, the
application and its process. Taught by notebook 06.
"""

"""plan: what a run will cost before it starts.

Hugging Face Jobs' flavors, the memory check of a plan, the pipeline simulator (the blog's runs as
data, its actors and records) and the planner that picks flavors, replicas and in-flight caps
from it. Taught by notebook 11.
"""

"""Stage 5, rollout: generation apart from training, joined by a rollout buffer.

The bounded, versioned buffer; the `Generator` interface and `LocalGenerator`; the asynchronous
trainer (a rollout worker thread, admission by staleness); `HTTPGenerator`, the same interface
over the servers of stage 4 with adapters through the bucket. Taught by notebooks 04 and 05.
"""

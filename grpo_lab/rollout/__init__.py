"""rollout: where a trainer's samples come from, apart from training.

The bounded, versioned rollout buffer; the `Generator` interface with `LocalGenerator` (in
process) and `HTTPGenerator` (inference servers, adapters through the bucket); the scored group
the rollout worker hands over; the check that servers serve the trainer's base model.
Taught by notebooks 04 and 05.
"""

"""bucket: the folder every job sees, carrying adapters and checkpoints.

Adapter publishing (hidden temp dir, chmod, atomic rename, retention) and the trainer's
checkpoints, written the same way. Taught by notebook 05 (checkpoints: notebook 07).
"""

"""util: what every other folder leans on, with no GRPO in it.

Command-line values (`argv`), files (atomic folders, JSON Lines), grpo_lab's home folder, process
groups (start, wait until healthy, stop), and where a model runs (`devices`).
"""

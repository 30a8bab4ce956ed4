"""util: what every other folder leans on, with no GRPO in it.

Command-line values (`argv`), atomic folders, grpo_lab's home folder, JSON Lines files, process
groups (start, wait until healthy, stop), and where a model runs (`devices`).
"""

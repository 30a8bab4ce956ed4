# EXERCISE 04.3
prediction = 2  # versions: one step's groups in the buffer, one batch in the making, 2 at most
looser_max_staleness = 8  # section 2's run: 1

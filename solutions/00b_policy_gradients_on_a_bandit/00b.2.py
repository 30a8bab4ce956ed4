# EXERCISE 00b.2
prediction = "more than twice"  # every answer is pushed by 1 or 2; the pushes cancel only on average
use_baseline = False  # set False

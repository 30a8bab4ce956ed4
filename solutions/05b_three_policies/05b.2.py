# EXERCISE 05b.2
prediction = "between k = 1 and k = 8"  # each version of lag adds one step's movement to kl
exercise_staleness = 4  # the knob: the run's max_staleness

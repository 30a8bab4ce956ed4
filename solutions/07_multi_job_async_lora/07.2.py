# EXERCISE 07.2
prediction = 0.8  # half of the first 6 steps' requests, then all of the last 10: 1 - 6 / 32
kill_replica_at_step = 6  # the knob: kill replica-0 after this step (1 to exercise_steps - 1)

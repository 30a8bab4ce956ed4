# EXERCISE 04.1
versions_in_buffer = [3, 5, 6, 6, 4, 7]
trainer_version, exercise_max_staleness = 7, 2
lags = [trainer_version - v for v in versions_in_buffer]
batch_staleness = [lag for lag in lags if lag <= exercise_max_staleness]
dropped = len(lags) - len(batch_staleness)

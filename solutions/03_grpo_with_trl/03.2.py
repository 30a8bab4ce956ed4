# EXERCISE 03.2
prediction = 0.7  # most problems are solved 0-40 % of the time: two samples often agree
group_size = 2  # completions per prompt (num_generations): set 2

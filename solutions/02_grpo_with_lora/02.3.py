# EXERCISE 02.3
prediction = "about the same"  # one bit of reward per episode leaves little for 8x the parameters
compare_rank = 8  # the rank to train against section 1's rank 1: set 8

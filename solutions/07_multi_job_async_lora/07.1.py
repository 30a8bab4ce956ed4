# EXERCISE 07.1
my_choice = "b"  # max_staleness + 1 = 2 versions

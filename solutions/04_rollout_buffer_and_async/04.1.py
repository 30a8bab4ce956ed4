# EXERCISE 04.1
my_choice = "a"  # staleness 4 and 3 exceed max_staleness = 2

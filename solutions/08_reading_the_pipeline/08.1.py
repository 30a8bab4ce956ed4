# EXERCISE 08.1
my_choice = "a"  # a full queue, a trainer that never waits, generation held back

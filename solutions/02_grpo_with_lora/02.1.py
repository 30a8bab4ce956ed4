# EXERCISE 02.1
my_choice = "a"  # r (in + out) is linear in r

# EXERCISE 11.2
my_choice = "c"  # (0.85 x 131.3 GiB - the weights) / 0.11 GiB a request: 994

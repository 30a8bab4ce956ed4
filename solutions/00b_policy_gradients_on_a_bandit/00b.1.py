# EXERCISE 00b.1
prediction = "about half"  # a mean over G answers: its spread falls as 1 / sqrt(G)
bigger_group = 32  # the group size to compare with G = 8: set 32

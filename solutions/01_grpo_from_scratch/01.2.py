# EXERCISE 01.2
my_choice = "a"  # the ratio moved past the clip in the advantage's direction

# EXERCISE 05.1
my_choice = "b"  # v11 is not published yet; compare numbers, not strings

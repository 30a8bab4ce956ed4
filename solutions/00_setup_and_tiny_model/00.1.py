# EXERCISE 00.1
my_choice = "a"  # <bos> and one id per character: 7 ids

# EXERCISE 01b.2
long_wrong_length = 64  # tokens of the longest wrong completion: set it to 64
prediction = 0.25  # grpo: 1 / (G |o_i|) per token, so 4x the tokens, a quarter of the push each

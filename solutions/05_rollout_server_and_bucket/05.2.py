# EXERCISE 05.2
prediction = 1.1  # above 1: the reported logprobs (T = 1) are lower than those sampled (T = 0.7)
served_logprobs_mode = "raw_logprobs"  # section 1's server: "processed_logprobs"

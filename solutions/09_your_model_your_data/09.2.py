# EXERCISE 09.2
prediction = 0.5  # most groups differ in correctness (rewards 0.2 and 1.2, std about 0.5)
scale_rewards = False  # GRPOConfig.scale_rewards for the run: set False

# EXERCISE 01.2
cases = [(1.5, 1.0), (0.5, -1.0), (0.5, 1.0), (1.5, -1.0)]  # (ratio, advantage)
clipped_losses = [-min(ratio * advantage, min(max(ratio, 0.8), 1.2) * advantage)
                  for ratio, advantage in cases]
print(clipped_losses)  # cases 1 and 2 are clipped: the loss no longer depends on the ratio

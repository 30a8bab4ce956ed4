# EXERCISE 00.2
p_right, G_exercise = 0.3, 8
p_no_signal = p_right**G_exercise + (1 - p_right) ** G_exercise
print(f"no signal in {p_no_signal:.1%} of groups; mixed in {1 - p_no_signal:.1%} "
      f"(observed above: {mixed_groups} of {len(problems)})")

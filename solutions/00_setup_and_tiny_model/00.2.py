# EXERCISE 00.2
p_right, G_exercise = 0.3, 8
p_no_signal = p_right**G_exercise + (1 - p_right) ** G_exercise
p_no_signal_per_problem = float((problem_p**G_exercise + (1 - problem_p) ** G_exercise).mean())
p_sampled = float(problem_p.mean())
print(f"no signal: {p_no_signal:.1%} at p = {p_right} (greedy); "
      f"{p_sampled**G_exercise + (1 - p_sampled) ** G_exercise:.1%} at p = {p_sampled:.2f} "
      f"(the mean of problem_p); {p_no_signal_per_problem:.1%} with each problem's own p; "
      f"observed: {no_signal_observed:.1%} of {right_per_group.numel()} groups")
# Why more groups teach nothing than the formula at p = 0.3 says:
# 1. GRPO samples at temperature 1, and a sample is right less often than the greedy answer
#    (problem_p.mean() against greedy_on_problems, section 6): p is smaller.
# 2. p is not the same for every problem. p**G + (1 - p)**G is convex in p, so its mean over the
#    problems is above its value at the mean p: a problem the model almost never solves (or
#    almost always does) gives a no-signal group almost every time, and a middling one cannot
#    make up for it. With each problem's own p the prediction is close to what section 6 saw.

# EXERCISE 02.2
def closeness_reward(completions, answer, **kwargs):
    rewards = []
    for completion, reference in zip(completions, answer):
        text = completion.strip()
        if not text.isdigit():
            rewards.append(0.0)
            continue
        rewards.append(max(0.0, 1 - abs(int(text) - int(reference)) / 10))
    return rewards
# The cell under the check prints both runs. Near misses now get a signal: almost no group has all rewards equal.
# A signal in every group is not a better signal, though: the reward now also pays for being
# close, which greedy exact-match accuracy does not count. Whether it learns faster here, the two
# printed accuracies say for this seed; one seed says little.

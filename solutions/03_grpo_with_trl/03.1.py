# EXERCISE 03.1
def partial_credit(completions, answer, **kwargs):
    rewards = []
    for completion, reference in zip(completions, answer):
        got, want = completion.strip(), str(reference).strip()
        same = sum(a == b for a, b in zip(got, want))
        rewards.append(same / len(want) if len(got) == len(want) else 0.0)
    return rewards

# EXERCISE 09.1
import re


def my_format_reward(completions, **kwargs):
    rewards = []
    for completion in completions:
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        rewards.append(1.0 if re.search(r"####\s*\S", text) else 0.0)
    return rewards

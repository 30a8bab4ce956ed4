# EXERCISE 01b.1
def my_token_weights(loss_type, lengths, max_completion_length):
    # the per-token weight w_i of each completion under `loss_type`: a tensor like `lengths`
    G = len(lengths)
    if loss_type == "grpo":  # each completion's mean, then the mean over the G completions
        return 1 / (G * lengths.float())
    if loss_type == "dapo":  # one mean over every token of the batch
        return torch.full((G,), 1 / lengths.sum().item())
    if loss_type == "dr_grpo":  # the sum over tokens divided by a constant
        return torch.full((G,), 1 / (G * max_completion_length))
    raise ValueError(f"unknown loss_type {loss_type!r}")

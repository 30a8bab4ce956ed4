# EXERCISE 01.3
def my_unclipped_surrogate(logps, old_logps, advantages):
    ratio = torch.exp(logps - old_logps)  # (B, T)
    return -ratio * advantages[:, None]  # every token keeps its gradient, however far it moved


prediction = 2.0  # kl without the clip / kl with it: about twice as far
# Without the clip, each of the 4 updates on a batch keeps pushing the tokens that already moved,
# so a batch moves the policy further from the one that sampled it. The clip is what bounds the
# step when a batch is used several times.

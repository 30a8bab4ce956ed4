# EXERCISE 05b.1
def my_decoupled_weights(prox_logps, behav_logps, mask, cap):
    # pi_prox / mu per token, 0 where it exceeds `cap`: a (B, T) tensor
    weights = torch.exp(prox_logps - behav_logps)  # (B, T) the behaviour's importance weight
    return torch.where(weights > cap, 0.0, weights)  # AReaL drops the tokens above its cap

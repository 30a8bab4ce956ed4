# EXERCISE 04.2
import torch


def my_truncated_weights(old_logps, sampler_logps, mask, clip_max):
    weights = torch.exp(old_logps - sampler_logps)  # pi_old / pi_sampler per token, (B, T)
    weights = torch.where(mask.bool(), weights, torch.ones_like(weights))  # padding weighs 1
    return weights.clamp(max=clip_max)  # truncated: no token weighs more than clip_max
# In the run, the ratio is exactly 1 on every step (it is taken against pi_old, the weights the
# update starts from), so the clip is centred on the current policy; the staleness moved into the
# weights, which spread around 1 and stop at the cap.

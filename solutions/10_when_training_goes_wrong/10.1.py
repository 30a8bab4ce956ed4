# EXERCISE 10.1
import torch


def mean_entropy(logits, mask, temperature=1.0):
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, T, V)
    entropy = -(logps.exp() * logps).sum(-1)  # (B, T): H = -sum_v p log p
    mask = mask.float()
    return ((entropy * mask).sum() / mask.sum()).item()

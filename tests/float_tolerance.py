"""Tolerances for tests that compare two float32 computations of the same number.

The rule. A float32 keeps 24 significant bits: one ulp of a value x is about EPS32 * |x|, with
EPS32 = 2**-23 = 1.19e-7. Every addition of a sum rounds once, so a float32 sum of n terms
carries an error of up to about n ulps of the terms' magnitude. Another summation order rounds
differently: ATen's kernels for another CPU (its default, AVX2 and AVX-512 levels differ in SIMD
width, so in the order of a reduction), another thread count, a fused kernel, or TRL's code
instead of grpo_lab's. Two float32 results of the same formula then differ by a few ulps of
their magnitude times the number of terms summed, on one machine as on another, so a tolerance
is

    atol = ULPS * EPS32 * magnitude * terms

`magnitude` is the size of the terms, not of the result: a loss that averages advantages of
+-1 can be ~0 and still carries their rounding. For a mean it is the terms' mean absolute size
(`mean_atol`: the classic bound n * eps * sum|x_i| on a sum, divided by n), for a tensor compared
entry by entry its largest entry. `terms` is the length of the sum. A bare absolute tolerance is
not one: 1e-6 on a KL of 4.3 is two ulps, which another CPU's AVX-512 kernels exceeded (issue
32), while 1e-6 on a value of 1e-3 lets a 0.1 % error pass. ULPS = 4: across ATen's default,
AVX2 and AVX-512 kernels, MKL's compatible path and 1 or 2 threads, the largest difference
measured was 0.15 of the tolerance (TRL parity gradients; losses and KL up to 0.11).

Logprobs are the output of a whole forward pass: a log-softmax over the vocabulary (a sum of
`vocab_size` terms) of logits of the size of the logprobs. `logprob_atol` holds them to that sum.
Everything computed from logprobs (ratios, KL, losses, metrics) inherits their error times its
sensitivity to them, and the tests say which.

Where exactness is the point (the same formula on the same inputs), tests compare exactly or in
float64 instead. Where a wrong result is cheap to make, a test keeps it as a negative case: the
uncorrected loss, an altered clip, a swapped mode differ by over 100 tolerances.
"""

from __future__ import annotations

import math

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2**-23 = 1.19e-7: one ulp of 1.0
ULPS = 4  # the "few ulps" per summed term


def f32_atol(magnitude: float, terms: int = 1, ulps: float = ULPS) -> float:
    """Absolute tolerance for float32 results whose terms have size `magnitude`, each summed over
    `terms` terms in an order that may differ: `ulps` ulps of `magnitude` per term."""
    return ulps * EPS32 * float(magnitude) * max(int(terms), 1)


def logprob_atol(logps: torch.Tensor, vocab_size: int, ulps: float = ULPS,
                 hidden_size: int | None = None) -> float:
    """Tolerance for per-token logprobs `logps` (real tokens only) computed by another code path:
    a log-softmax sums `vocab_size` terms of the logits' size, which is the logprobs' size.

    With `hidden_size` (a real vocabulary, where vocab x size over-counts by orders of magnitude)
    the two errors are taken apart: each logit is a sum of `hidden_size` products of the logits'
    size, and the log-sum-exp adds `vocab_size` probabilities, each at most 1."""
    size = logps.detach().abs().max().item()
    if hidden_size is None:
        return f32_atol(size, vocab_size, ulps)
    return f32_atol(size, hidden_size, ulps) + f32_atol(1.0, vocab_size, ulps)


def mean_atol(terms: torch.Tensor, ulps: float = ULPS) -> float:
    """A mean of `terms` computed in another order: `f32_atol` of their mean absolute size over
    their count (for terms of one sign: a few ulps of the mean, times the count)."""
    terms = terms.detach()
    return f32_atol(terms.abs().mean().item(), terms.numel(), ulps)


def _values(x) -> torch.Tensor:
    if isinstance(x, dict):
        return torch.tensor([float(x[k]) for k in sorted(x)], dtype=torch.float64)
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).flatten()
    return torch.tensor([float(v) for v in x] if isinstance(x, (list, tuple)) else [float(x)],
                        dtype=torch.float64)


def assert_f32_close(actual, expected, atol: float, what: str = "") -> float:
    """`actual` == `expected` to `atol` (floats, tensors, or dicts with the same keys; NaN only
    where both are NaN); returns the largest difference."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (what, actual,
                                                                               expected)
    a, e = _values(actual), _values(expected)
    assert a.shape == e.shape, (what, a.shape, e.shape)
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(e)), (what, "NaN in one only", actual, expected)
    diff = (a - e).abs()[~nan]
    worst = diff.max().item() if diff.numel() else 0.0
    assert worst <= atol, (
        f"{what}: differ by {worst:.3g} > atol {atol:.3g} "
        f"({worst / atol if atol else math.inf:.2f} x the tolerance)", actual, expected)
    return worst


def assert_grads_close(actual: dict, expected: dict, terms: int, ulps: float = ULPS) -> float:
    """Gradients (parameter name -> tensor), each tensor held to `f32_atol` of its largest entry
    with `terms` the positions whose contributions each entry sums; returns the largest
    difference in units of its tolerance."""
    assert actual.keys() == expected.keys() and expected
    worst = 0.0
    for name, want in expected.items():
        atol = f32_atol(want.abs().max().item(), terms, ulps)
        diff = assert_f32_close(actual[name], want, atol, name)
        worst = max(worst, diff / atol if atol else 0.0)
    return worst

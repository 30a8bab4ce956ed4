"""grpo_lab_course.loss_views: notebook 01b's set-ups and reports."""

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
import torch

from grpo_lab_course import loss_views as views


def test_toy_distributions_are_softmaxes_with_their_exact_kl():
    torch.manual_seed(0)
    policy, reference, kl = views.toy_distributions(8)
    assert policy.sum().item() == pytest.approx(1.0) and reference.shape == (8,)
    exact = torch.nn.functional.kl_div(reference.log(), policy, reduction="sum").item()
    assert kl == pytest.approx(exact)
    assert kl > 0


def test_z_score_counts_standard_errors():
    samples = torch.tensor([1.0, 3.0, 1.0, 3.0])  # mean 2, std 2/sqrt(3), n 4
    assert views.z_score(samples, 2.0) == pytest.approx(0.0)
    assert views.z_score(samples, 1.0) == pytest.approx(3 ** 0.5, rel=1e-5)


def test_clip_panels_draw_one_column_per_advantage():
    ratios = torch.linspace(0.5, 1.5, 11)
    binds = ratios > 1.2
    panels = {1.0: (ratios, torch.where(binds, 0.0, ratios), binds),
              -1.0: (-ratios, -ratios, ~binds)}
    fig = views.plot_clip_panels(ratios, panels, (0.8, 1.2))
    assert len(fig.axes) == 4 and fig.axes[1].get_title() == "A = -1: objective per token"
    plt.close(fig)


def test_kl_drift_report_prints_each_run_and_draws_logged_kl_only_with_beta(capsys):
    def run(beta, acc):
        trainer = SimpleNamespace(config=SimpleNamespace(beta=beta),
                                  accuracy_history=[(0, 0.25), (4, acc)])
        records = [{"step": 2, "kl": 0.1}, {"step": 4, "kl": 0.2}]
        return trainer, records, {0: (0.0, 0.0), 4: (0.3, 0.4)}
    fig = views.report_kl_drift({"beta = 0": run(0.0, 0.5), "beta = 1": run(1.0, 0.75)}, 4)
    out = capsys.readouterr().out
    assert "exact KL after 4 steps 0.4000, greedy accuracy 25.0% -> 75.0%" in out
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert "beta = 1: logged `kl`" in labels and "beta = 0: logged `kl`" not in labels
    plt.close(fig)


def test_kl_gradient_table_prints_the_losses_and_a_row_per_loss(capsys):
    loss = torch.tensor(0.5, requires_grad=True) * 1.0  # as the notebook's losses: with a graph
    views.print_kl_gradient_table({"k3": loss}, torch.tensor(0.25), {"k3 (default)": (1e-17, 0.3)})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "expected loss: k3 0.500000, exact KL(pi_theta || pi_ref) 0.250000"
    assert out[-1].split() == ["k3", "(default)", "1.0e-17", "3.0e-01"]

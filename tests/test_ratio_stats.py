"""The ratio's summaries and histogram (grpo_lab_course.ratio_stats) read the tokens' ratios."""

import math

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from grpo_lab_course.ratio_stats import (
    collate_choices,
    mismatch_summary,
    plot_ratio_histogram,
    ratio_histogram_data,
    ratio_summary,
)

RATIO = torch.tensor([[0.5, 2.0, 1.0], [1.0, 1.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the 9 is padding


def test_summary_reads_real_tokens_only():
    s = ratio_summary(RATIO, MASK)
    real = [0.5, 2.0, 1.0, 1.0, 1.0]
    assert s["tokens"] == 5 and s["max"] == 2.0 and s["min"] == 0.5
    assert s["mean"] == pytest.approx(sum(real) / 5) and s["deviation"] == 1.0
    k3 = sum((r - 1) - math.log(r) for r in real) / 5
    assert s["k3"] == pytest.approx(k3, rel=1e-5)


def test_collate_pads_prompts_left_and_completions_right():
    rows = [{"prompt_token_ids": [1, 2], "token_ids": [5],
             "logprobs": {"token_logprobs": [-0.5]}},
            {"prompt_token_ids": [3], "token_ids": [6, 7],
             "logprobs": {"token_logprobs": [-1.0, -2.0]}}]
    b = collate_choices(rows, pad_id=0)
    assert b["p_ids"].tolist() == [[1, 2], [0, 3]] and b["c_mask"].tolist() == [[1, 0], [1, 1]]
    assert b["served"].tolist() == [[-0.5, 0.0], [-1.0, -2.0]]


def test_mismatch_of_an_identical_sample_is_none():
    rows = [{"token_ids": [1, 2]}, {"token_ids": [3]}]
    logps = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    m = mismatch_summary(rows, logps, logps.clone(), mask, rows)
    assert m["same_tokens"] == 1 and m["max_diff"] == 0 and m["weight_deviation"] == 0
    shifted = mismatch_summary(rows, logps + 0.1 * mask, logps, mask, rows)
    assert shifted["max_diff"] == pytest.approx(0.1) and shifted["ratio_max"] > 1.1


def test_histogram_draws_every_real_token():
    fig = plot_ratio_histogram({"right": (torch.ones(2, 3), MASK), "wrong": (RATIO, MASK)})
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and len(ax.patches) == 2
    assert ratio_histogram_data(RATIO, MASK).numel() == 5
    means = sorted(line.get_xdata()[0] for line in ax.get_lines())
    assert means == pytest.approx([1.0, 1.1])


def test_ratio_on_new_server_measures_then_stops_the_server(monkeypatch):
    from grpo_lab.serve import client as client_module
    from grpo_lab.serve import process as process_module
    from grpo_lab_course import ratio_stats

    calls = []

    class Server:
        url = "http://fake"

        def stop(self):
            calls.append("stop")

    class Engine:
        def __init__(self, url):
            calls.append(("client", url))

        def load_lora_adapter(self, name, path):
            calls.append(("load", name, path))

        def completions(self, prompts, **kwargs):
            row = {"prompt_token_ids": [1], "token_ids": [2, 3],
                   "logprobs": {"token_logprobs": [-1.0, -1.0]}}
            return {"choices": [row]}

        def close(self):
            calls.append("close")

    monkeypatch.setattr(process_module, "start_server_process",
                        lambda model, **flags: calls.append(("start", flags)) or Server())
    monkeypatch.setattr(client_module, "BlockingClient", Engine)
    monkeypatch.setattr(ratio_stats, "policy_logprobs",  # the trainer: log 2 above the server
                        lambda *args: torch.tensor([[-1.0 + math.log(2), -1.0]]))

    class Tokenizer:
        pad_token_id = 0

    s = ratio_stats.ratio_on_new_server(None, Tokenizer(), "/bucket/policy-v4", "policy-v4", [[1]],
                                        logprobs_mode="raw_logprobs")
    assert s["mean"] == pytest.approx(1.5) and s["max"] == pytest.approx(2.0)
    assert calls[0] == ("start", {"enable_lora": True, "max_lora_rank": 8,
                                  "logprobs_mode": "raw_logprobs"})
    assert ("load", "policy-v4", "/bucket/policy-v4") in calls and calls[-1] == "stop"


def test_nudge_lora_moves_only_the_lora_weights():
    model = torch.nn.Module()
    model.lora_A, model.base = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    from grpo_lab_course.ratio_stats import nudge_lora

    nudge_lora(model, torch.Generator().manual_seed(0), scale=0.1)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == {"lora_A.weight", "lora_A.bias"}


def test_sync_summary_returns_the_median(capsys):
    from grpo_lab_course.ratio_stats import sync_summary

    syncs = [{"sync_s": s, "bytes": 10, "write_s": 0.1} for s in (0.3, 0.1, 0.2)]
    assert sync_summary(syncs) == 0.2
    assert "3 weight syncs: p50 200 ms, max 300 ms" in capsys.readouterr().out


def test_compare_engines_flags_a_different_api(monkeypatch):
    from grpo_lab_course import ratio_stats

    class Engine:
        def __init__(self, fields):
            self.fields = fields

        def load_lora_adapter(self, name, path):
            return "ok"

        def unload_lora_adapter(self, name):
            return "ok"

    def score(engine, *args, **kwargs):
        row = {"token_ids": [1], "prompt_token_ids": [0], "logprobs": engine.fields}
        return [row], torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1)

    monkeypatch.setattr(ratio_stats, "score_completions", score)
    same = {"a": Engine({"token_logprobs": []}), "b": Engine({"token_logprobs": []})}
    mismatch, matches = ratio_stats.compare_engines(same, None, None, [[0]], "v", "/p")
    assert matches and mismatch["b"]["same_tokens"] == 1
    other = {"a": Engine({"token_logprobs": []}), "b": Engine({"top_logprobs": []})}
    assert not ratio_stats.compare_engines(other, None, None, [[0]], "v", "/p")[1]

"""grpo_lab_course.routing_plots: names from X-Proxy-Upstream, load statuses, the routing
comparison's replicas, and the drawn data equal to the records (no server, no proxy)."""

import matplotlib

matplotlib.use("Agg")
import math
from types import SimpleNamespace

import pytest

from grpo_lab.serve.client import ServerError
from grpo_lab_course import routing_plots


def test_upstream_names_maps_known_urls_and_keeps_the_order():
    names = {"http://a": "A", "http://b": "B"}
    assert routing_plots.upstream_names("http://b,http://a,http://c", names) == "B,A,http://c"
    assert routing_plots.upstream_names("", names) == ""


def test_load_status_reads_the_error():
    class Client:
        def __init__(self, error=None):
            self.error = error

        def load_lora_adapter(self, name, path):
            if self.error:
                raise self.error
            return "ok"

    assert routing_plots.load_status(Client(), "policy-v1", "/x") == (200, "ok")
    body = '{"error": {"message": "B refused; rolled back", "type": "x", "code": 500}}'
    status, message = routing_plots.load_status(
        Client(ServerError("POST", "/v1/load_lora_adapter", 500, body)), "policy-v2", "/y")
    assert status == 500 and "rolled back" in message


def test_compare_routings_adds_and_stops_extra_replicas(monkeypatch):
    seen, stopped = [], []
    monkeypatch.setattr(routing_plots, "routing_run",
                        lambda urls, model, prompts, routing, **kw: seen.append((routing, urls))
                        or {"routing": routing})
    extra = SimpleNamespace(url="http://c", stop=lambda: stopped.append("c"))
    runs = routing_plots.compare_routings(["http://a", "http://b"], "tiny", [[1, 2]],
                                          start_replica=lambda: extra, extra_replicas=1)
    assert list(runs) == list(routing_plots.ROUTINGS)
    assert all(urls == ["http://a", "http://b", "http://c"] for _, urls in seen)
    assert stopped == ["c"]


def test_plots_draw_the_records():
    replay = {"group_size": 3, "by_rollout_index": {"affinity": [0, 5, 6], "spill": [0, 1, 0],
                                                    "unmatched": [7, 1, 1]}}
    fig = routing_plots.plot_rollout_routing(replay)
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert heights == [0, 5, 6, 0, 1, 0, 7, 1, 1]
    fig = routing_plots.plot_placement({"1+2=": ["A", "A"], "3+4=": ["B", "A"]})
    assert fig.axes[0].images[0].get_array().tolist() == [[0, 0], [1, 0]]
    runs = {"affinity": {"prefix_cache_hit_rate": 0.7, "prefill_tokens_computed": 448,
                         "seconds": 1.0},
            "round-robin": {"prefix_cache_hit_rate": 0.6, "prefill_tokens_computed": 704,
                            "seconds": 1.1}}
    fig = routing_plots.plot_routing_runs(runs)
    assert [p.get_height() for p in fig.axes[1].patches] == [448, 704]


def test_replica_ratios_pins_the_deviation_on_the_replica(monkeypatch):
    import torch

    from grpo_lab.algo import logprobs

    def answer(logps):  # one completion of two tokens, its served logprobs
        return {"choices": [{"prompt_token_ids": [1], "token_ids": [2, 3],
                             "logprobs": {"token_logprobs": logps}}]}

    answers = [(answer([-1.0, -1.0]), "A"), (answer([-1.0, -1.5]), "B")]
    trainer = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])  # the policy agrees with A only
    monkeypatch.setattr(logprobs, "policy_logprobs",
                        lambda model, *args: trainer if model == "policy" else trainer - 0.5)
    per = routing_plots.replica_ratios(answers, "policy", "base", pad_id=0)
    assert per["samples"] == {"A": 1, "B": 1} and per["deviation"]["A"] == 0
    assert per["deviation"]["B"] == pytest.approx(math.exp(0.5) - 1, rel=1e-5)
    assert abs(per["k3"]["A"]) < 1e-9 < per["k3"]["B"]


def test_routing_gap_and_blocks(capsys):
    runs = {"affinity": {"prefix_cache_hit_rate": 0.75, "prefill_tokens_computed": 400},
            "round-robin": {"prefix_cache_hit_rate": 0.5, "prefill_tokens_computed": 800}}
    for run in runs.values():
        run.update(prompt_tokens=1, cached_prompt_tokens=0, seconds=1.0, router={})
    assert routing_plots.routing_gap(runs) == (0.25, 0.5)
    tokenizer = SimpleNamespace(decode=lambda ids: "x" * len(ids))
    routing_plots.show_blocks(tokenizer, list(range(5)), template_tokens=2, block=2)
    lines = capsys.readouterr().out.splitlines()[-3:]
    assert [line.split()[-1] for line in lines] == ["template", "own", "cached"]

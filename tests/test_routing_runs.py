"""grpo_lab_course.routing_runs refuses bad input before it starts a proxy or sends a request.
Its live runs are checked where they run: notebook 06 (tiny model) and
tests/test_routing_cache.py (the benchmark, chat model)."""

import pytest

from grpo_lab_course.routing_runs import ROUTINGS, routing_run, send_groups


def test_routing_run_names_the_routings_it_knows():
    with pytest.raises(ValueError, match="affinity.*round-robin"):
        routing_run(["http://127.0.0.1:9"], "tiny", [[1, 2, 3]], routing="random")
    assert ROUTINGS == ("affinity", "round-robin")


def test_routing_run_needs_prompts():
    with pytest.raises(ValueError, match="no prompts"):
        routing_run(["http://127.0.0.1:9"], "tiny", [], routing="affinity")


@pytest.mark.parametrize("field", ["group_size", "max_tokens", "max_inflight"])
def test_send_groups_refuses_counts_below_one(field):
    with pytest.raises(ValueError, match=">= 1"):
        send_groups("http://127.0.0.1:9", "tiny", [[1, 2, 3]], **{field: 0})

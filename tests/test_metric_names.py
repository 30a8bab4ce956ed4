"""grpo_lab's metric names against TRL's: the two trainers' mappings
(grpo_lab.watch.metric_names.TRL_SYNC_NAMES, TRL_ASYNC_NAMES) read against the source of the
installed TRL.

TRL's AsyncGRPOTrainer appends its metrics to a few sinks (`self.metrics[...]`,
`self._metrics["train"][...]`, the rollout worker's `_push_metrics({...})`, `_rates`,
`_counters`, each sample's `metrics = {...}`), TRL's GRPOTrainer to `self._metrics[mode][...]`,
and transformers' Trainer adds `logs["loss"]` and `logs["grad_norm"]`. The keys are read from
those files with `ast`, nothing of TRL is imported.
(tests/test_async_trainer.py checks that every name the trainer logs has a row.)
"""

from __future__ import annotations

import ast
import importlib.util
from fnmatch import fnmatch
from pathlib import Path

import pytest

from grpo_lab.watch.metric_names import METRICS, TRL_ASYNC_NAMES, TRL_SYNC_NAMES, glossary_name


def _package_dir(name: str) -> Path:
    return Path(importlib.util.find_spec(name).origin).parent


ASYNC_GRPO = _package_dir("trl") / "experimental" / "async_grpo"
TRL_ASYNC_SOURCES = [ASYNC_GRPO / "async_grpo_trainer.py", ASYNC_GRPO / "async_rollout_worker.py"]
TRL_SYNC_SOURCE = _package_dir("trl") / "trainer" / "grpo_trainer.py"
TRANSFORMERS_TRAINER = _package_dir("transformers") / "trainer.py"
SINKS = ("metrics", "_metrics['train']", "_metrics[mode]", "_rates", "_counters", "logs")


def _key(node: ast.AST | None) -> str | None:
    """A key as the mapping writes it: `f"rewards/{name}"` -> `rewards/<name>`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "<name>" for v in node.values)
    return None


def logged_keys(path: Path) -> set[str]:
    """Every string key the file appends to one of the metric sinks."""
    keys = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith(SINKS):
            keys.add(_key(node.slice))
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("_push_metrics"):
            keys.update(_key(k) for arg in node.args if isinstance(arg, ast.Dict)
                        for k in arg.keys)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "metrics" for t in node.targets):
            for sub in ast.walk(node.value):  # a sample's metrics, `**{f"rewards/{n}": ...}` too
                if isinstance(sub, ast.Dict):
                    keys.update(_key(k) for k in sub.keys)
                elif isinstance(sub, ast.DictComp):
                    keys.add(_key(sub.key))
    keys.discard(None)
    return keys


@pytest.fixture(scope="module")
def trl_async_keys() -> set[str]:
    keys = set().union(*(logged_keys(path) for path in TRL_ASYNC_SOURCES))
    assert {"kl", "ratio", "sample/staleness_mean", "perf/step_s"} <= keys, "the sinks moved"
    return keys


@pytest.fixture(scope="module")
def trl_sync_keys() -> set[str]:
    keys = logged_keys(TRL_SYNC_SOURCE)
    assert {"kl", "entropy", "reward", "step_time", "rewards/<name>/mean"} <= keys, "sinks moved"
    return keys


@pytest.fixture(scope="module")
def trainer_keys() -> set[str]:
    keys = logged_keys(TRANSFORMERS_TRAINER)
    assert {"loss", "grad_norm"} <= keys, "transformers' Trainer logs elsewhere now"
    return keys


def test_every_trl_name_in_the_mapping_is_one_trl_logs(trl_async_keys, trainer_keys):
    missing = [r.trl for r in TRL_ASYNC_NAMES
               if r.trl and r.trl not in trl_async_keys | trainer_keys]
    assert not missing, f"TRL's AsyncGRPOTrainer logs none of {missing}"


def test_the_same_quantity_has_trls_name_and_a_different_one_never_does(trl_async_keys,
                                                                         trainer_keys):
    for row in TRL_ASYNC_NAMES:
        if row.same:
            assert row.ours == row.trl, f"{row.ours} is TRL's {row.trl}: use TRL's name"
        elif row.ours:
            assert row.ours not in trl_async_keys | trainer_keys, (
                f"{row.ours} is not TRL's quantity of that name: rename it")


def test_every_glossary_name_trl_async_logs_is_mapped_as_the_same(trl_async_keys):
    """The clash this mapping exists for: a name in the glossary that TRL's asynchronous
    trainer also logs must be the same quantity there."""
    same = {r.ours for r in TRL_ASYNC_NAMES if r.same}
    clashes = sorted(set(METRICS) & trl_async_keys - same)
    assert not clashes, f"logged by TRL's AsyncGRPOTrainer as something else: {clashes}"


def test_the_sync_mapping_against_trls_grpo_trainer(trl_sync_keys, trainer_keys):
    """The same three rules for the synchronous trainer and TRL's GRPOTrainer: every TRL name
    is one it logs, a "same" row uses TRL's name, a different quantity never does, and every
    glossary name that TRL's GRPOTrainer logs is mapped as the same."""
    logged = trl_sync_keys | trainer_keys
    missing = [r.trl for r in TRL_SYNC_NAMES if r.trl and r.trl not in logged]
    assert not missing, f"TRL's GRPOTrainer logs none of {missing}"
    for row in TRL_SYNC_NAMES:
        if row.same:
            assert row.ours == row.trl, f"{row.ours} is TRL's {row.trl}: use TRL's name"
        elif row.ours:
            assert row.ours not in logged, f"{row.ours} is not TRL's quantity of that name"
    same = {r.ours for r in TRL_SYNC_NAMES if r.same}
    clashes = sorted(set(METRICS) & trl_sync_keys - same)
    assert not clashes, f"logged by TRL's GRPOTrainer as something else: {clashes}"


@pytest.mark.parametrize("rows", [TRL_SYNC_NAMES, TRL_ASYNC_NAMES], ids=["sync", "async"])
def test_every_grpo_lab_name_in_the_mapping_is_in_the_glossary_once(rows):
    ours = [r.ours for r in rows if r.ours]
    assert len(ours) == len(set(ours))
    trls = [r.trl for r in rows if r.trl]
    assert len(trls) == len(set(trls))
    unexplained = [n for n in ours if not any(fnmatch(m, n) for m in METRICS)]
    assert not unexplained, f"not in grpo_lab.watch.metric_names.METRICS: {unexplained}"
    assert glossary_name("rewards/format") == "rewards/<name>"
    assert glossary_name("rewards/format/std") == "rewards/<name>/std"


def test_async_reward_metrics_are_reduced_as_trls_rollout_worker_does():
    import numpy as np
    import torch

    from grpo_lab.watch.step_metrics import async_reward_names

    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0, 1.0, 0.0])  # G = 4
    ours = async_reward_names({"reward": 0.5, "reward_std": rewards.std().item(),
                               "rewards/format/mean": 0.25, "rewards/format/std": 0.1},
                              rewards, group_size=4)
    # TRL's worker: each sample carries np.std of its group's rewards; the log averages samples
    per_sample = [np.std(g) for g in rewards.view(3, 4).numpy() for _ in range(4)]
    assert ours["reward_std"] == pytest.approx(float(np.mean(per_sample)))
    assert ours["reward_std"] != pytest.approx(rewards.std().item())  # not GRPOTrainer's
    assert {k: ours[k] for k in ("rewards/format", "rewards/format/std")} == {
        "rewards/format": 0.25, "rewards/format/std": 0.1}
    assert "rewards/format/mean" not in ours


TRL_THROUGHPUT_AND_LAYOUT = (  # TRL 1.16 AsyncGRPOTrainer's names that issue 35 listed
    "perf/mfu_fwd_bwd", "perf/mfu_wall_clock", "perf/forwarded_tok_s_fwd_bwd",
    "perf/forwarded_tok_s_wall_clock", "perf/trained_tok_s_wall_clock", "batch/samples_per_row",
    "batch/row_fill_frac", "batch/pad_frac", "batch/row_tokens_mean", "batch/row_tokens_max",
    "batch/row_imbalance", "batch/groups_per_step", "batch/dropped_oversize_total",
    "batch/masked_token_frac", "sample/trained_tokens_mean", "sample/forwarded_tokens_mean",
    "sample/forwarded_tokens_max", "rollout/vllm_retry_total", "rollout/score_wait_s",
    "rollout/score_queue_size", "rollout/duration_s", "clip_ratio/high_max",
)


def test_trls_throughput_and_layout_names_each_have_a_row(trl_async_keys):
    """Each is logged by TRL and has a row: grpo_lab's same quantity, or why there is none."""
    assert set(TRL_THROUGHPUT_AND_LAYOUT) <= trl_async_keys
    rows = {r.trl: r for r in TRL_ASYNC_NAMES}
    missing = [n for n in TRL_THROUGHPUT_AND_LAYOUT if n not in rows]
    assert not missing, f"no row in TRL_ASYNC_NAMES: {missing}"
    assert all(rows[n].same or rows[n].note for n in TRL_THROUGHPUT_AND_LAYOUT)
    assert rows["perf/mfu_fwd_bwd"].same and rows["perf/mfu_wall_clock"].same


def test_trls_mfu_is_a_percentage_as_grpo_labs():
    """TRL's `compute_mfu` returns `100 * ...`: grpo_lab.watch.flops.mfu logs the same unit."""
    source = (_package_dir("trl") / "trainer" / "utils.py").read_text()
    (func,) = [n for n in ast.walk(ast.parse(source))
               if isinstance(n, ast.FunctionDef) and n.name == "compute_mfu"]
    (ret,) = [n for n in ast.walk(func) if isinstance(n, ast.Return)]
    assert ast.unparse(ret.value).startswith("100 * ")

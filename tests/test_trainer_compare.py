"""grpo_lab_course.trainer_compare: the side-by-side summaries of notebooks 02, 03 and 09."""

from types import SimpleNamespace

import pytest

from grpo_lab.watch.metric_names import TRLName
from grpo_lab_course import trainer_compare as compare


def _records():
    return [{"step": 0}] + [{"step": s, "reward": s / 10, "frac_reward_zero_std": 1.0 if s <= 2
                             else 0.0} for s in range(1, 11)]


def test_first_last_no_signal_and_summary():
    records = _records()
    assert compare.first_and_last(records, n=2) == pytest.approx((0.15, 0.95))
    assert compare.no_signal(records, 4) == pytest.approx(0.5)
    summary = compare.run_summary(records, [(0, 0.25), (4, 0.5)], at=4)
    assert summary == pytest.approx(dict(no_signal=0.5, accuracy=0.5, gain=0.25, accuracy_step=4))
    # a learner's knobs: read at step 5, evaluated at 0 and 4 only; or longer than the run
    assert compare.run_summary(records, [(0, 0.25), (4, 0.5)], at=5)["accuracy_step"] == 4
    assert compare.run_summary(records[:3], [(0, 0.25)], at=50)["accuracy_step"] == 0


def test_config_rows_find_a_mismatch(capsys):
    config = SimpleNamespace(**{n: 1 for n in compare.SAME_NAME}, steps=5, prompts_per_step=2,
                             scale_rewards=True, epsilon_low=0.2,
                             lora_rank=1, effective_lora_alpha=2)
    ours = SimpleNamespace(max_completion_length=5,
                           optimizer=SimpleNamespace(defaults={"weight_decay": 0.0,
                                                               "betas": (0.9, 0.95)}))
    args = SimpleNamespace(**{n: 1 for n in compare.SAME_NAME}, max_steps=5,
                           per_device_train_batch_size=2, max_completion_length=5,
                           scale_rewards="group", epsilon=0.2,
                           lr_scheduler_type=SimpleNamespace(value="constant"),
                           weight_decay=0.0, adam_beta2=0.999)
    rows = compare.config_rows(config, ours, args, SimpleNamespace(r=1, lora_alpha=2))
    mismatches = compare.print_rows(rows)
    assert [r[0] for r in mismatches] == ["(AdamW beta2)"]
    assert len(capsys.readouterr().out.splitlines()) == len(rows)


def test_print_names_counts_a_name_one_run_did_not_log(capsys):
    names = [TRLName("reward", "reward", True, ""), TRLName("grad_norm", "grad_norm", True, ""),
             TRLName("rewards/<name>/mean", "rewards/<name>/mean", True, "")]
    ours, trl = [{"reward": 1, "grad_norm": 2}], [{"reward": 1, "rewards/f/mean": 0.5}]
    assert compare.logged("rewards/<name>/mean", trl) and not compare.logged(None, trl)
    assert compare.print_names(names, ours, trl) == [("grad_norm", "grad_norm")]
    assert compare.print_names(names) is None
    assert len(capsys.readouterr().out.splitlines()) == 8  # a header and 3 rows, twice

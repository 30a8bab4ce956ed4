"""The run doctor for TRL's trainers: `DoctorCallback`, a `transformers.TrainerCallback`.

TRL's `GRPOTrainer` and `AsyncGRPOTrainer` log the names grpo_lab logs (`reward`,
`frac_reward_zero_std`, `completions/clipped_ratio`, `entropy`, `clip_ratio/*`, `kl`, ...), so
the same doctor reads their logs:

    trainer = trl.GRPOTrainer(..., callbacks=[DoctorCallback()])
    trainer.train()
    trainer.callback_handler.callbacks[-1].findings   # or keep a reference to the callback
"""

from __future__ import annotations

from transformers import TrainerCallback

from ..watch.doctor import Doctor


class DoctorCallback(TrainerCallback):
    """Feeds every log of a `transformers.Trainer` (TRL's GRPO trainers) to a `Doctor` and
    prints each finding once, when it first appears. `findings`: every finding so far."""

    def __init__(self, doctor: Doctor | None = None, write=print):
        self.doctor = doctor or Doctor()
        self.write = write
        self.findings = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        record = {"step": state.global_step, **{k: v for k, v in logs.items()
                                                if isinstance(v, (int, float))}}
        for finding in self.doctor.observe(record):
            self.findings.append(finding)
            self.write(finding.text())

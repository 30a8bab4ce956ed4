"""The run doctor for TRL's trainers: `DoctorCallback`, a `transformers.TrainerCallback`.

TRL's `GRPOTrainer` and `AsyncGRPOTrainer` log the names grpo_lab logs (`reward`,
`frac_reward_zero_std`, `completions/clipped_ratio`, `entropy`, `clip_ratio/*`, `kl`, ...), so
the same doctor reads their logs:

    trainer = trl.GRPOTrainer(..., callbacks=[DoctorCallback()])
    trainer.train()
    trainer.callback_handler.callbacks[-1].findings   # or keep a reference to the callback

Before the first step it also reads the first training prompt as TRL sends it: a plain string to
a model with a chat template goes untemplated (TRL applies the template to conversational
prompts only), which grpo_lab's own trainer names too (`chat_template_skipped`).
"""

from __future__ import annotations

from transformers import TrainerCallback

from ..watch.doctor import Doctor, chat_template_finding


class DoctorCallback(TrainerCallback):
    """Feeds every log of a `transformers.Trainer` (TRL's GRPO trainers) to a `Doctor` and
    prints each finding once, when it first appears. `findings`: every finding so far."""

    def __init__(self, doctor: Doctor | None = None, write=print):
        self.doctor = doctor or Doctor()
        self.write = write
        self.findings = []

    def on_train_begin(self, args, state, control, processing_class=None, train_dataloader=None,
                       model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        # The run's sampling temperature and (for a LoRA adapter, as grpo_lab's trainers do) its
        # learning rate, where the doctor was not told them: causes can then name them.
        if self.doctor.temperature is None:
            self.doctor.temperature = getattr(args, "temperature", None)
        if self.doctor.learning_rate is None and hasattr(model, "peft_config"):
            self.doctor.learning_rate = getattr(args, "learning_rate", None)
        dataset = getattr(train_dataloader, "dataset", None)
        try:
            prompt = dataset[0]["prompt"]
        except Exception:  # no dataset, one read only by iterating (TRL's async trainer's),
            return        # or not TRL's `prompt` column: the check is skipped, training goes on
        tokenizer = getattr(processing_class, "tokenizer", processing_class)  # a processor's
        finding = chat_template_finding(tokenizer, prompt) if tokenizer is not None else None
        if finding is not None:
            self.findings.append(finding)
            self.write(finding.text())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        record = {"step": state.global_step, **{k: v for k, v in logs.items()
                                                if isinstance(v, (int, float))}}
        for finding in self.doctor.observe(record):
            self.findings.append(finding)
            self.write(finding.text())

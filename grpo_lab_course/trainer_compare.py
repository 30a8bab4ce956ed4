"""Two runs side by side: grpo_lab's `GRPOTrainer` and TRL's on the same run (notebook 03),
short runs that change one thing (notebook 02), greedy answers before and after training (09).

`trl_trainer(args, lora, dataset, config)` builds TRL's trainer on grpo_lab's model with a
progress bar that prints grpo_lab's one-line step summary; `first_and_last` and `no_signal` read
both trainers' records; `config_rows` pairs the two configs' values and `print_rows` prints them;
`print_names` prints the metric-name glossary with what each run logged. `short_run` and
`run_summary`: a short run's no-signal share, accuracy and gain. `print_answers` shows greedy
completions with their rewards; `describe_model` a trainer's model in one line.
"""

from __future__ import annotations

from fnmatch import fnmatch
from statistics import fmean


def step_lines(total: int, every: int):
    """A TRL callback: a progress bar, and every `every` steps grpo_lab's step summary line."""
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    from grpo_lab.train.trainer import format_step

    class StepLines(TrainerCallback):
        def __init__(self):
            self.bar = tqdm(total=total, desc="TRL GRPO")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.bar.update(1)
                if state.global_step % every == 0:
                    self.bar.write(format_step({**logs, "step": state.global_step,
                                                "perf/step_s": logs["step_time"]}, total))

    return StepLines()


def trl_trainer(args, lora, train_dataset, config, reward_funcs=None, every: int = 40):
    """TRL's `GRPOTrainer` on grpo_lab's model for `config` (its tokenizer too), grpo_lab's exact
    match reward by default, TRL's per-log dict printer replaced by `step_lines`."""
    from transformers.trainer_callback import PrinterCallback

    from grpo_lab.trl.cpu import require_trl

    require_trl()
    from trl import GRPOTrainer as TRLTrainer

    from grpo_lab.data.rewards import exact_match_reward
    from grpo_lab.model.models import load_model_and_tokenizer
    from grpo_lab.train.trainer import GRPOTrainer

    model, tokenizer = load_model_and_tokenizer(GRPOTrainer.resolve_model_path(config))
    trainer = TRLTrainer(model=model, reward_funcs=reward_funcs or exact_match_reward, args=args,
                         train_dataset=train_dataset, processing_class=tokenizer,
                         peft_config=lora)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(step_lines(args.max_steps, every))
    return trainer


def first_and_last(records: list[dict], n: int = 20) -> tuple[float, float]:
    """The mean reward of the first and of the last n steps."""
    rewards = [r["reward"] for r in records if "reward" in r]
    return fmean(rewards[:n]), fmean(rewards[-n:])


def no_signal(records: list[dict], steps: int) -> float:
    """The share of groups whose G rewards were all equal, over steps 1..steps (nan: no step)."""
    shares = [r["frac_reward_zero_std"] for r in records
              if 0 < r["step"] <= steps and "frac_reward_zero_std" in r]
    return fmean(shares) if shares else float("nan")


SAME_NAME = ("num_generations", "temperature", "loss_type", "epsilon_high", "beta",
             "num_iterations", "learning_rate", "max_grad_norm", "seed")


def config_rows(config, ours, args, lora) -> list[tuple]:
    """(grpo_lab name, its value, TRL name, TRL's value) for every field that carries a value:
    `config` and `ours` (grpo_lab's GRPOConfig and trainer), `args` and `lora` (TRL's
    GRPOConfig and peft's LoraConfig)."""
    adamw = ours.optimizer.defaults
    return [(name, getattr(config, name), name, getattr(args, name)) for name in SAME_NAME] + [
        ("steps", config.steps, "max_steps", args.max_steps),
        ("prompts_per_step * num_generations", config.prompts_per_step * config.num_generations,
         "per_device_train_batch_size", args.per_device_train_batch_size),
        ("max_completion_length (None = answer + 2)", ours.max_completion_length,
         "max_completion_length", args.max_completion_length),
        ("scale_rewards (True / False)", {True: "group", False: "none"}[config.scale_rewards],
         "scale_rewards ('group' / 'none')", args.scale_rewards),
        ("epsilon_low", config.epsilon_low, "epsilon", args.epsilon),
        ("(constant learning rate)", "constant", "lr_scheduler_type",
         getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        ("(AdamW weight decay)", adamw["weight_decay"], "weight_decay", args.weight_decay),
        ("(AdamW beta2)", adamw["betas"][1], "adam_beta2", args.adam_beta2),
        ("lora_rank", config.lora_rank, "peft_config.r", lora.r),
        ("effective_lora_alpha", config.effective_lora_alpha, "peft_config.lora_alpha",
         lora.lora_alpha),
    ]


def print_rows(rows: list[tuple]) -> list[tuple]:
    """Prints the rows of `config_rows`, each with whether the two values are equal; returns the
    rows whose values differ."""
    for ours_name, ours_value, trl_name, trl_value in rows:
        print(f"{ours_name:36s} {ours_value!s:>9s}   {trl_name:32s} {trl_value!s:>9s}  "
              f"{ours_value == trl_value}")
    return [r for r in rows if r[1] != r[3]]


def logged(name: str | None, records: list[dict]) -> bool:
    """Whether any record has the metric `name` (`<name>` in it matches any reward's name)."""
    return name is not None and any(fnmatch(k, name.replace("<name>", "*"))
                                    for r in records for k in r)


def _show_table(rows: list[dict], summary: str) -> None:
    """A long table: collapsed HTML in a notebook (a learner opens it), aligned text elsewhere."""
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        import html

        head = "".join(f"<th style='text-align:left'>{html.escape(k)}</th>" for k in rows[0])
        body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(str(v))}</td>"
                                        for v in row.values()) + "</tr>" for row in rows)
        display(HTML(f"<details><summary>{html.escape(summary)}</summary><table><thead><tr>"
                     f"{head}</tr></thead><tbody>{body}</tbody></table></details>"))
        return
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in rows[0]}
    for row in [dict(zip(rows[0], rows[0])), *rows]:
        print("  ".join(f"{str(v):{widths[k]}s}" for k, v in row.items()).rstrip())


def print_names(names, our_records=None, trl_records=None,
                not_expected=("kl", "sampling/", "rewards/")) -> list[tuple] | None:
    """Prints a glossary (`grpo_lab.watch.metric_names` rows), with whether each run logged each
    name when records are given; then returns the (grpo_lab, TRL) pairs one run did not log,
    those starting with `not_expected` left out (None without records)."""
    rows = [{"grpo_lab": row.ours or "-", "TRL": row.trl or "-", "same": row.same,
             **({} if our_records is None else {"logged (grpo_lab / TRL)":
                f"{logged(row.ours, our_records)} / {logged(row.trl, trl_records)}"}),
             "note": row.note} for row in names]
    _show_table(rows, f"{len(rows)} metric names, side by side (click to open)")
    if our_records is None:
        return None
    return [(r.ours, r.trl) for r in names if r.ours and r.trl
            and not r.ours.startswith(tuple(not_expected))
            and not (logged(r.ours, our_records) and logged(r.trl, trl_records))]


def print_answers(trainer, rewards, problems, title: str) -> None:
    """Greedy answers of `trainer`'s model to `problems`, each printed with its reward (a
    `RewardSet`) and the reference's final answer."""
    from grpo_lab.model.generation import generate_completions

    trainer.model.eval()
    out = generate_completions(trainer.model, trainer.tokenizer, [p.prompt for p in problems],
                               max_new_tokens=trainer.max_completion_length, do_sample=False,
                               **trainer.prompt_format)
    scores, _ = rewards.score(out.texts, [p.answer for p in problems])
    print(f"== {title}")
    for p, text, s in zip(problems, out.texts, scores):
        print(f"Q: {p.prompt}\nA: {text!r}  (reward {s:.1f}; reference "
              f"{p.answer.split('####')[-1].strip()})")


def describe_model(trainer) -> str:
    """The trainer's model in one line: its class, parameter count, device and dtype."""
    model = trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return (f"the model: {type(base).__name__}, {sum(p.numel() for p in model.parameters()):,} "
            f"parameters; device {trainer.device}, dtype {next(model.parameters()).dtype}")


def run_summary(records: list[dict], history: list[tuple], at: int) -> dict:
    """A short run in three numbers: the no-signal share over steps 1..at, the greedy accuracy at
    step `at` (from `history`, the trainer's (step, accuracy) list) and its gain. A run shorter
    than `at`, or not evaluated at `at` (a learner's changed knobs), is read at its last
    evaluation up to `at`, named in `accuracy_step`."""
    evaluated = dict(history)
    step = max((s for s in evaluated if s <= at), default=min(evaluated))
    accuracy = evaluated[step]
    return dict(no_signal=no_signal(records, at), accuracy=accuracy,
                gain=accuracy - history[0][1], accuracy_step=step)


def short_run(config, steps: int, rewards=None, **changes) -> dict:
    """`config`'s run trained for `steps` steps with `changes` to it (and `rewards`, a
    `RewardSet`, in place of its reward when given): its `run_summary` at the last step."""
    from dataclasses import replace

    from grpo_lab.train.trainer import GRPOTrainer

    trainer = GRPOTrainer(replace(config, steps=steps, eval_every=0, log_every=steps,
                                  output_dir=None, **changes))
    trainer.rewards = trainer.rewards if rewards is None else rewards
    return run_summary(trainer.train(), trainer.accuracy_history, steps)



def plot_before_after(problems, replies: dict[str, list[str]], right: dict[str, list[bool]],
                      kinds: dict[str, list[int]], shown: int = 8, title: str = ""):
    """The same held-out problems before and after training. Left: how many replies fall in each
    kind (`kinds`: name -> [count before, count after], stacked in their order, the right kind
    first). Right: the first `shown` problems with their greedy replies (`replies`: "before" and
    "after" -> one text per problem), green where `right` says the reply earned the full reward.
    Returns the figure."""
    import matplotlib.pyplot as plt

    fig, (bars, table) = plt.subplots(1, 2, figsize=(12, 3.9), width_ratios=(1, 2.6))
    bottoms = [0, 0]
    for (name, counts), colour in zip(kinds.items(), ("tab:green", "tab:orange", "tab:red")):
        bars.bar(["before", "after"], counts, bottom=bottoms, color=colour, label=name)
        for x, (count, bottom) in enumerate(zip(counts, bottoms)):
            if count >= 0.06 * len(problems):
                bars.text(x, bottom + count / 2, str(count), ha="center", va="center", fontsize=9)
        bottoms = [b + c for b, c in zip(bottoms, counts)]
    bars.set_ylabel(f"held-out problems (of {len(problems)})")
    bars.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    table.axis("off")
    cell = dict(fontsize=9, family="monospace", transform=table.transAxes)
    for x, heading in zip((0.0, 0.36, 0.68), ("question", "before", "after")):
        table.text(x, 1.0, heading, weight="bold", **cell)
    for row, problem in enumerate(problems[:shown], start=1):
        top = 1 - row / (shown + 1.5)
        question = problem.prompt
        question = question if isinstance(question, str) else question[-1]["content"]
        table.text(0.0, top, _clip(question, 26), **cell)
        for x, when in zip((0.36, 0.68), ("before", "after")):
            table.text(x, top, _clip(repr(replies[when][row - 1]), 30),
                       color="tab:green" if right[when][row - 1] else "tab:red", **cell)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _clip(text: str, width: int) -> str:
    """One line of at most `width` characters (whitespace runs become one space)."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"

"""`grpo-lab`: the command line. Flags are generated from the config dataclasses' docstrings.

    grpo-lab demo                        the main job: GRPO on the tiny model, summary, plots
    grpo-lab train --steps 100 ...       GRPO with any GRPOConfig field as a flag
    grpo-lab train-async --server-url URL --output-dir DIR [--resume]
                                         the trainer job: async LoRA GRPO against servers
    grpo-lab train-trl-async ...         the same job with TRL's AsyncGRPOTrainer
    grpo-lab build-model [--kind chat]   build (or find) the cached tiny (or chat) model
    grpo-lab serve tiny --enable-lora    an inference server speaking vLLM's HTTP contract
    grpo-lab proxy --upstream URL ...    several servers behind one URL, KV-prefix routing
    grpo-lab launch [--dry-run]          the recipe's jobs (replicas, proxy, trainer), local or HF
    grpo-lab plan --deadline-h 2         HF Jobs flavors, replicas and settings, cost and wall clock
    grpo-lab doctor RUN_DIR              name what is silently wrong in a run folder

Each command is a module of grpo_lab.cli with `add_parser` and `run`: `grpo-lab COMMAND --help`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("demo", "train", "build-model", "serve", "proxy", "launch", "train-async",
            "train-trl-async", "doctor", "plan")
"""Each command lives in its own module, `grpo_lab.cli.<command>` (`-` as `_`), which exports
`add_parser(sub)` (its flags; `set_defaults(func=run)`) and `run(args) -> int` (the exit status).
Flags come from config dataclasses whose modules import torch, transformers or the trainer,
seconds on a small machine: a process started for one command (a proxy imports neither) imports
and builds only that command's module and flags."""


def _command_module(command: str):
    return importlib.import_module(f"{__package__}.{command.replace('-', '_')}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI; with `command`, only that subcommand gets its flags (the others are listed)."""
    parser = argparse.ArgumentParser(prog="grpo-lab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        if command in (None, name) or command not in COMMANDS:
            _command_module(name).add_parser(sub)
        else:
            sub.add_parser(name)
    return parser


def _end_launched_processes() -> None:
    """Several processes (`accelerate launch`): all done, then their group closed. Only a
    command that imported torch.distributed can have started one (the CLI starts fast);
    end_launched_processes checks the launch itself."""
    if "torch.distributed" in sys.modules:
        from ..train.distributed import end_launched_processes

        end_launched_processes()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        code = args.func(args)
        _end_launched_processes()
        return code
    except (ValueError, FileNotFoundError) as exc:  # bad input: a clear message, no traceback
        print(f"grpo-lab: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

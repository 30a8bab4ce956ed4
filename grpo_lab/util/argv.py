"""grpo_lab's command-line convention for config values, read and written in one place.

A bool flag alone means true (`--enable-lora`); false is written out (`--use-lora false`);
None is left out (the default applies). `parse_bool` reads a value back (grpo_lab.cli.flags
builds every grpo-lab parser with it); `flag_args` writes config values as argv (the commands
that start `grpo-lab serve`, `grpo-lab proxy` and `grpo-lab train-async`). vLLM's own CLI
(`vllm serve`) has its own convention: its commands are written as vLLM reads them.
"""

from __future__ import annotations

import argparse

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_bool(text: str) -> bool:
    """`true`/`false` (also 1/0, yes/no, on/off, any case) -> bool."""
    if text.lower() in TRUE_WORDS:
        return True
    if text.lower() in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def flag_args(flags: dict) -> list[str]:
    """{"enable_lora": True, "use_lora": False, "max_loras": 4, "seed": None} ->
    ["--enable-lora", "--use-lora", "false", "--max-loras", "4"]."""
    args = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args += [flag, "false"]
        elif value is not None:
            args += [flag, str(value)]
    return args

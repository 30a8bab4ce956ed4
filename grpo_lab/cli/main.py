"""`grpo-lab`: the command line. Flags are generated from the config dataclass and its docstrings.

    grpo-lab demo                    the main job: GRPO on the tiny model, summary, plots, metrics
    grpo-lab train --steps 100 ...   a GRPO run with any GRPOConfig field as a flag; on several
                                     processes: accelerate launch ... -m grpo_lab.cli train ...
    grpo-lab train-async --server-url URL --output-dir DIR [--resume]
                                     the trainer job: async LoRA GRPO against servers, a bucket
    grpo-lab train-trl-async --server-url URL --output-dir DIR
                                     the same job with TRL's AsyncGRPOTrainer
    grpo-lab build-model [--kind chat]
                                     build (or find) the cached tiny (or chat) model, print its folder
    grpo-lab notebook 01 [--with-solutions]
                                     execute a course notebook with papermill (exercises solved)
    grpo-lab serve tiny --enable-lora --port 8000
                                     an inference server speaking vLLM's HTTP contract
    grpo-lab launch --backend hf-jobs --bucket hf://buckets/me/lora --dry-run
                                     the recipe's jobs (replicas, proxy, trainer), local or HF
    grpo-lab proxy --upstream URL --upstream URL --port 8000
                                     several servers behind one URL, routed by KV-prefix affinity
"""

from __future__ import annotations

import argparse
import os
import sys

from .flags import BOOL_FLAG, add_config_flags, config_from_args


def _add_demo(sub) -> None:
    from ..rollout.config import AsyncGRPOConfig

    demo = sub.add_parser("demo", help="the main job: GRPO on the tiny offline model, with a summary")
    demo.add_argument("--min-gain", type=float, default=None,
                      help="exit with status 1 unless greedy accuracy rises by this much (e.g. 0.2); "
                      "the summary reports against it (default 0.2)")
    demo.add_argument("--jobs", choices=("none", "local"), default="local",
                      help="local: the recipe's jobs (a trainer, replicas, the proxy, a bucket "
                      "folder) as local processes; none: synchronous GRPO in this process")
    demo.add_argument("--replicas", type=int, default=2, help="inference replicas (--jobs local)")
    demo.add_argument("--engine", choices=("grpo-lab", "vllm"), default="grpo-lab",
                      help="the replicas' server (--jobs local): grpo-lab (`grpo-lab serve`) or "
                      "vllm (real vLLM; its CPU build on a CPU, `make vllm`)")
    add_config_flags(demo, AsyncGRPOConfig, defaults={"log_every": 20, "output_dir": None})


def _add_train(sub) -> None:
    train = sub.add_parser("train", help="a GRPO run; every GRPOConfig field is a flag")
    add_config_flags(train)


def _add_build_model(sub) -> None:
    build = sub.add_parser("build-model", help="build (or find) the cached tiny model")
    build.add_argument("--kind", choices=("tiny", "chat"), default="tiny",
                       help="tiny: the default Llama on --task; chat: the Qwen2 with a BPE "
                       "tokenizer and ChatML, on word problems (--task is ignored)")
    build.add_argument("--task", default="addition")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--rebuild", default=False, **BOOL_FLAG)
    build.add_argument("--threads", type=int, default=os.cpu_count(),
                       help="torch threads for the build (default: every core; run it alone)")


def _add_notebook(sub) -> None:
    nb = sub.add_parser("notebook", help="execute a course notebook with papermill")
    nb.add_argument("name", help="number or name, e.g. 01")
    nb.add_argument("--output-dir", default=None, help="where the executed copy goes")
    nb.add_argument("--with-solutions", default=False, **BOOL_FLAG,
                    help="fill every exercise cell with its solution (solutions/) first: the "
                    "teacher's copy, as the tests run it")


def _add_serve(sub) -> None:
    from ..serving.config import ServeConfig

    serve = sub.add_parser("serve", help="an inference server speaking vLLM's HTTP contract "
                           "(env gates: VLLM_SERVER_DEV_MODE, VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    serve.add_argument("model", help="hub id or local path of the base model; `tiny` = the "
                       "offline tiny model")
    add_config_flags(serve, ServeConfig, exclude=("model",))
    serve.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                       action="store_false", help="turn prefix caching off (as in vLLM)")


def _add_proxy(sub) -> None:
    from ..proxy.config import ProxyConfig

    proxy = sub.add_parser("proxy", help="several inference servers behind one URL: KV-prefix "
                           "routing, broadcast pause/resume/adapter loads, health")
    proxy.add_argument("--upstream", dest="upstreams", action="append", required=True,
                       metavar="URL", help="base URL of one replica; repeat once per replica")
    add_config_flags(proxy, ProxyConfig, exclude=("upstreams",))


def _add_launch(sub) -> None:
    from .launch import add_launch_parser

    add_launch_parser(sub)


def _add_train_async(sub) -> None:
    from .train_async import add_train_async_parser

    add_train_async_parser(sub)


def _add_train_trl_async(sub) -> None:
    from .train_trl_async import add_train_trl_async_parser

    add_train_trl_async_parser(sub)


SUBCOMMANDS = {"demo": _add_demo, "train": _add_train, "build-model": _add_build_model,
               "notebook": _add_notebook, "serve": _add_serve, "proxy": _add_proxy,
               "launch": _add_launch, "train-async": _add_train_async,
               "train-trl-async": _add_train_trl_async}
"""Each command's parser. Its flags come from config dataclasses whose modules import torch,
transformers or the trainer, seconds on a small machine: a process started for one command
(a proxy imports neither) builds only that command's flags."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI; with `command`, only that subcommand gets its flags (the others are listed)."""
    parser = argparse.ArgumentParser(prog="grpo-lab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, add in SUBCOMMANDS.items():
        if command in (None, name) or command not in SUBCOMMANDS:
            add(sub)
        else:
            sub.add_parser(name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        if args.command == "demo":
            if args.jobs == "local":
                from .multi_job import multi_job_config, run_multi_job_demo

                config = multi_job_config(args)
                summary = run_multi_job_demo(config, replicas=args.replicas,
                                             min_gain=args.min_gain or 0.20, engine=args.engine)
            else:
                from .demo import run_demo

                summary = run_demo(config_from_args(args), min_gain=args.min_gain or 0.20)
            if args.min_gain is not None and summary["accuracy_gain"] < args.min_gain:
                print(f"FAILED: gain {summary['accuracy_gain']:+.1%} < {args.min_gain:.0%}")
                return 1
        elif args.command == "train":
            from ..train.trainer import GRPOTrainer

            trainer = GRPOTrainer(config_from_args(args))  # any number of processes
            trainer.train()
            if trainer.processes.is_main:
                print("greedy accuracy by step:", trainer.accuracy_history)
        elif args.command == "train-async":
            from .train_async import train_async_main

            return train_async_main(args)
        elif args.command == "train-trl-async":
            from .train_trl_async import train_trl_async_main

            return train_trl_async_main(args)
        elif args.command == "build-model":
            if args.kind == "chat":
                from ..core.chat_model import ChatModelRecipe, chat_model_path

                print(chat_model_path(ChatModelRecipe(seed=args.seed), rebuild=args.rebuild,
                                      num_threads=args.threads))
            else:
                from ..core.tiny_model import TinyModelRecipe, tiny_model_path

                print(tiny_model_path(TinyModelRecipe(task=args.task, seed=args.seed),
                                      rebuild=args.rebuild, num_threads=args.threads))
        elif args.command == "notebook":
            from .notebooks import run_notebook

            print(run_notebook(args.name, args.output_dir, with_solutions=args.with_solutions))
        elif args.command == "launch":
            from .launch import launch_main

            return launch_main(args)
        elif args.command == "serve":
            from ..serving.config import ServeConfig
            from ..serving.serve_loop import serve

            serve(config_from_args(args, ServeConfig))
        elif args.command == "proxy":
            from ..proxy.app import serve_proxy
            from ..proxy.config import ProxyConfig

            serve_proxy(config_from_args(args, ProxyConfig))
    except (ValueError, FileNotFoundError) as exc:  # bad input: a clear message, no traceback
        print(f"grpo-lab: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

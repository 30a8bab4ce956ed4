"""`grpo-lab serve tiny --enable-lora --port 8000`: an inference server speaking vLLM's HTTP
contract (grpo_lab.serve); its flags are ServeConfig's fields."""

from __future__ import annotations

from ..serve.config import ServeConfig
from .flags import add_config_flags, config_from_args


def add_parser(sub) -> None:
    serve = sub.add_parser("serve", help="an inference server speaking vLLM's HTTP contract "
                           "(env gates: VLLM_SERVER_DEV_MODE, VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    serve.add_argument("model", help="the base model: `tiny`, `tiny-chat`, `smollm2-135m` "
                       "(grpo_lab's offline models), a hub id or a local folder")
    add_config_flags(serve, ServeConfig, exclude=("model",))
    serve.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                       action="store_false", help="turn prefix caching off (as in vLLM)")
    serve.set_defaults(func=run)


def run(args) -> int:
    from ..serve.server import serve  # the engine and the HTTP app: only when serving

    serve(config_from_args(args, ServeConfig))
    return 0

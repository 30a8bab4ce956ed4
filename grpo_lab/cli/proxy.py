"""`grpo-lab proxy --upstream URL --upstream URL --port 8000`: several inference servers behind
one URL, routed by KV-prefix affinity (grpo_lab.proxy); its flags are ProxyConfig's fields."""

from __future__ import annotations

from ..proxy.config import ProxyConfig
from .flags import add_config_flags, config_from_args


def add_parser(sub) -> None:
    proxy = sub.add_parser("proxy", help="several inference servers behind one URL: KV-prefix "
                           "routing, broadcast pause/resume/adapter loads, health")
    proxy.add_argument("--upstream", dest="upstreams", action="append", required=True,
                       metavar="URL", help="base URL of one replica; repeat once per replica")
    add_config_flags(proxy, ProxyConfig, exclude=("upstreams",))
    proxy.set_defaults(func=run)


def run(args) -> int:
    from ..proxy.app import serve_proxy

    serve_proxy(config_from_args(args, ProxyConfig))
    return 0

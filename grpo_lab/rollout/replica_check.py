"""Before a trainer samples from inference servers: do they serve its base model?

An adapter trained on one base model means nothing on another, yet a replica started with another
`--model` of the same shape loads it and samples without complaint. `check_replicas` asks each
replica's /v1/models (vLLM's model cards: the base model's `id`, the name requests use, and its
`root`, the path or hub id it was loaded from; then one card per loaded adapter, `parent` = the
base) and refuses to start when one names another base model than the trainer's:

    check_replicas("http://127.0.0.1:8000", "Qwen/Qwen3-0.6B")   # {replica: its base card}

Behind `grpo-lab proxy` (its /proxy/stats lists the replicas) every replica is asked directly; one
this process cannot reach (an HF Jobs replica wants the token the proxy adds) is reported, not
guessed at. The proxy's own /v1/models answer names the replica it came from.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

from ..model.models import MADE_MODELS

BUILT_MODELS = MADE_MODELS
"""grpo_lab's own models by short name: each machine keeps them in its own cache folder
(`<GRPO_LAB_HOME>/models/<key>`), so they are compared by that folder's name."""

_HUB_CACHE_DIR = re.compile(r"models--([^/]+)--([^/]+)")  # huggingface_hub's snapshot folders

Fetch = Callable[[str], tuple[object, dict]]
"""GET a URL -> (its JSON, its headers); raises OSError (or ValueError) when it cannot."""


def fetch_json(url: str, *, api_key: str | None = None, timeout_s: float = 10.0
               ) -> tuple[object, dict]:
    """GET `url` with a bounded timeout -> (the JSON body, the headers)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return json.loads(reply.read()), dict(reply.headers)


def base_card(models: object) -> dict:
    """The base model's card of a /v1/models answer: the first without a `parent`."""
    cards = models.get("data") if isinstance(models, dict) else None
    for card in cards if isinstance(cards, list) else []:
        if isinstance(card, dict) and not card.get("parent"):
            return card
    raise ValueError(f"no base model card in this /v1/models answer: {str(models)[:200]}")


def model_aliases(name: str) -> set[str]:
    """The names one model goes by: as given (no trailing slash), its real path when it is a
    folder here, and `owner/name` when it is a snapshot folder of the hub's cache."""
    name = str(name).rstrip("/") or "/"
    aliases = {name}
    if os.path.isdir(name):
        aliases.add(os.path.realpath(name))
    hub = _HUB_CACHE_DIR.search(name)
    if hub:
        aliases.add(f"{hub.group(1)}/{hub.group(2)}")
    return aliases


def serves_model(card: dict, model: str, model_path: str | None = None) -> bool:
    """Whether a base model card names the trainer's model: `model` as the trainer was given
    it, `model_path` where it loads it from (grpo_lab.train.policy_model's
    `resolve_model_path`). A built model (`tiny`...) is its cache folder's name, wherever the
    replica's cache is."""
    served = [str(card[k]) for k in ("id", "root") if card.get(k)]
    if model in BUILT_MODELS and model_path:
        return Path(str(model_path)).name in {Path(s.rstrip("/")).name for s in served}
    wanted = model_aliases(model) | (model_aliases(model_path) if model_path else set())
    return any(wanted & model_aliases(s) for s in served)


def proxy_replicas(server_url: str, fetch: Fetch) -> list[str]:
    """The replicas behind `server_url` when it is `grpo-lab proxy` (its /proxy/stats), else []."""
    try:
        stats, _ = fetch(server_url + "/proxy/stats")
    except (OSError, ValueError):  # a server, not the proxy: 404
        return []
    upstreams = stats.get("upstreams") if isinstance(stats, dict) else None
    return [str(u).rstrip("/") for u in upstreams] if isinstance(upstreams, list) else []


def check_replicas(server_url: str, model: str, model_path: str | None = None, *,
                   api_key: str | None = None, timeout_s: float = 10.0,
                   fetch: Fetch | None = None) -> tuple[dict[str, dict], dict[str, str]]:
    """({replica: its base model card}, {replica: why it could not be asked}) for the server,
    or every replica behind the proxy, at `server_url`. Raises ValueError naming each replica
    that serves another base model than `model`, and when `server_url` does not answer."""
    fetch = fetch or (lambda url: fetch_json(url, api_key=api_key, timeout_s=timeout_s))
    server_url = server_url.rstrip("/")
    try:  # what the trainer's requests reach: a server, or one replica through the proxy
        models, headers = fetch(server_url + "/v1/models")
        first = {k.lower(): v for k, v in headers.items()}.get("x-proxy-upstream", server_url)
        cards = {first.rstrip("/"): base_card(models)}
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot ask {server_url}/v1/models which base model it serves: "
                         f"{exc}") from None
    unreachable = {}
    for replica in proxy_replicas(server_url, fetch):
        if replica in cards:
            continue
        try:
            cards[replica] = base_card(fetch(replica + "/v1/models")[0])
        except (OSError, ValueError) as exc:
            unreachable[replica] = str(exc)
    wrong = {r: c for r, c in cards.items() if not serves_model(c, model, model_path)}
    if wrong:
        served = "; ".join(f"{r} serves {c.get('id')!r} (root {c.get('root')!r})"
                           for r, c in wrong.items())
        where = f" ({model_path})" if model_path and str(model_path) != model else ""
        raise ValueError(f"the replicas must serve the trainer's base model {model!r}{where}, "
                         f"but {served}: start them with that model, or train the one they "
                         "serve")
    return cards, unreachable

"""`HTTPGenerator`: the `Generator` of asynchronous GRPO backed by inference servers over HTTP.

It swaps `LocalGenerator` for a server (or a proxy in front of several) without touching the
training loop. `publish` is TRL's adapter-only LoRA sync (the bucket, pause, load `policy-vN`,
resume, unload the version `max_staleness + 1` behind); `generate` sends /v1/completions requests
in the "group" (n = G) or "single" (G of n = 1, TRL's) shape, with the config's sampling settings
(`request_body`). Every version has its own name (docs/internals.md, "Generators";
docs/serving-api.md, "How TRL's AsyncGRPOTrainer drives a server").
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from ..bucket.adapters import AdapterBucket, adapter_name
from ..data.completions import Completions
from ..model.models import MADE_MODELS
from ..serve.client import BlockingClient, ServerError
from ..serve.sampling_settings import SAMPLING_FIELDS

RETRY_STATUSES = (502, 503, 504)
"""The proxy's answers when a replica fails under a request: worth sending it again."""

REQUEST_SHAPES = ("group", "single")
"""One request with n = G per prompt, or G requests with n = 1 per prompt (TRL's)."""


def request_body(prompt_ids: list[int], *, model: str, n: int, max_tokens: int,
                 temperature: float, seed: int, sampling: dict | None = None) -> dict:
    """One /v1/completions request (docs/serving-api.md): `n` samples of policy `model` after
    `prompt_ids`, with the sampled tokens' ids and logprobs. Every sampling parameter is named,
    so the server's defaults (a model card's, without `--generation-config vllm`) never choose;
    by default untruncated (top_p 1, top_k 0, min_p 0, no penalty), as a trainer scoring
    log_softmax(logits / T) needs. Stop strings and ids go only when set."""
    sampling = {**dict.fromkeys(SAMPLING_FIELDS), **(sampling or {})}
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling settings {sorted(unknown)} (known: "
                         f"{SAMPLING_FIELDS})")
    body = {"prompt": list(prompt_ids), "model": model, "n": n, "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": float(1.0 if sampling["top_p"] is None else sampling["top_p"]),
            "top_k": int(sampling["top_k"] or 0),
            "min_p": float(sampling["min_p"] or 0.0),
            "repetition_penalty": float(1.0 if sampling["repetition_penalty"] is None
                                        else sampling["repetition_penalty"]),
            "seed": seed, "logprobs": 0, "return_token_ids": True}
    for name in ("stop", "stop_token_ids"):  # grpo_lab's server refuses `stop` strings
        if sampling[name]:
            body[name] = list(sampling[name])
    return body


class HTTPGenerator:
    """Samples from policy versions loaded on an inference server; publishes through a bucket."""

    def __init__(self, url: str, bucket: AdapterBucket, *, api_key: str | None = None,
                 max_staleness: int = 1, load_timeout_s: float = 60.0,
                 retry_every_s: float = 0.25, seed: int | None = None,
                 request_timeout_s: float = 600.0, retries: int = 0,
                 max_inflight: int | None = None, request_shape: str = "group",
                 sampling: dict | None = None):
        if max_inflight is not None and max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1 or None (got {max_inflight})")
        if request_shape not in REQUEST_SHAPES:
            raise ValueError(f"request_shape must be one of {REQUEST_SHAPES} "
                             f"(got {request_shape!r})")
        request_body([], model="", n=1, max_tokens=1, temperature=1.0, seed=0,
                     sampling=sampling)  # unknown settings fail here, not mid-run
        self.bucket = bucket
        self.max_staleness = max_staleness
        self.load_timeout_s, self.retry_every_s = load_timeout_s, retry_every_s
        self.client = BlockingClient(url, api_key=api_key, timeout_s=request_timeout_s)
        self._rng = random.Random(seed)  # request seeds: reproducible runs when seeded
        self._lock = threading.Lock()  # publish (trainer thread) vs generate (worker thread)
        self._latest = -1
        self.loaded: list[int] = []
        """Versions loaded on the server, oldest first."""
        self.syncs: list[dict] = []
        """Per publish: seconds of each stage and bytes written."""
        self.retries = retries
        """Times a completion or weight-sync call answered 502/503/504 is sent again
        (0 = fail at once)."""
        self.retried = 0
        """Completion requests and weight-sync calls sent again so far."""
        self.request_shape = request_shape
        """"group": one request per prompt with n = G; "single": G requests of n = 1 per
        prompt (TRL's rollout worker, the blog's)."""
        self.sampling = dict(sampling or {})
        """top_p, top_k, min_p, repetition_penalty, stop, stop_token_ids of every request
        (grpo_lab.serve.sampling_settings' `sampling_settings(config)`; unset = untruncated);
        temperature and max_tokens come with each `generate` call."""
        self.max_inflight = max_inflight
        """Most completion requests in flight at once within one `generate` call (None = all of
        its requests at once): the recipe's "client cap on in-flight requests", a knob of the
        pipeline's balance. It counts requests, so what it bounds depends on the shape:
        "group": prompts (each G completions; a cap above prompts_per_step changes nothing);
        "single": completions, as TRL's cap counts them (above prompts_per_step * G, nothing).
        The async trainer's worker generates one step at a time."""
        self.inflight_peak = 0
        """The most requests that were in flight at once so far (completions with "single")."""
        self._inflight = 0
        self._recent_peak = 0  # since the last `pop_inflight_peak`
        self.unloaded_at_start: list[str] | None = None  # None: start_after_earlier_runs not run

    def name(self, version: int) -> str:
        return adapter_name(version, self.bucket.prefix)

    @property
    def latest_version(self) -> int:
        with self._lock:
            return self._latest

    def start_after_earlier_runs(self) -> int:
        """Before a run's first publish: unload the adapters of this bucket's prefix that the
        server still holds (an earlier or failed run's: never sample from them, and their names
        would clash), and return the first version no earlier run used (a bucket never reuses a
        version's name). The unloaded names are kept in `unloaded_at_start`."""
        prefix = self.bucket.prefix + "-v"
        self.unloaded_at_start = [m["id"] for m in self.client.models()
                                  if m["id"].startswith(prefix)]
        for name in self.unloaded_at_start:
            self._control(self.client.unload_lora_adapter, name, unload=True)
        for version in self.bucket.versions():
            self.bucket.mark_unloaded(version)
        return max(self.bucket.versions(), default=-1) + 1

    def publish(self, model, version: int) -> None:
        if version <= self.latest_version:
            raise ValueError(f"versions must increase: {version} after {self.latest_version}")
        t0 = time.perf_counter()
        path = self.bucket.publish(model, version)  # 1. write + atomic rename
        t1 = time.perf_counter()
        self._control(self.client.pause, "keep")  # 2.
        try:
            t2 = time.perf_counter()
            self._control(self.client.load_lora_adapter, self.name(version), str(path),  # 3.
                          retry_not_found_s=self.load_timeout_s,
                          retry_every_s=self.retry_every_s)
            t3 = time.perf_counter()
            with self._lock:  # on the server from now on, even if resume fails
                self.loaded.append(version)
        finally:
            self._control(self.client.resume)  # 4.
        t4 = time.perf_counter()
        with self._lock:
            self._latest = version
            retire = [v for v in self.loaded if v < version - self.max_staleness]
        for old in retire:  # 5.
            self._control(self.client.unload_lora_adapter, self.name(old), unload=True)
            self.bucket.mark_unloaded(old)
            with self._lock:
                self.loaded.remove(old)
        t5 = time.perf_counter()
        self.syncs.append({"version": version, "bytes": self.bucket.last_publish["bytes"],
                           "publish_s": t1 - t0, "pause_s": t2 - t1, "load_s": t3 - t2,
                           "resume_s": t4 - t3, "unload_s": t5 - t4, "sync_s": t5 - t0})

    def _control(self, call, *args, unload: bool = False, **kwargs):
        """A weight-sync call, sent again (up to `retries` times, a second apart) while the
        proxy answers 502/503/504: a replica died and the proxy is taking it out. A retried
        unload may find the name already gone where it ran before (404): that is done."""
        for attempt in range(self.retries + 1):
            try:
                return call(*args, **kwargs)
            except ServerError as exc:
                if unload and attempt and exc.status == 404:
                    return None
                if exc.status not in RETRY_STATUSES or attempt == self.retries:
                    raise
                self.retried += 1
                time.sleep(1.0)

    async def _generate(self, prompt_ids, name, n, max_new_tokens, temperature, seeds):
        """One request per entry of `prompt_ids`, each with `n` samples. A request the server
        (or proxy) answers 502/503/504 (a replica went down under it) is sent again, up to
        `retries` times; the answers that came back are kept, so no sample is counted twice."""
        replies: list = [None] * len(prompt_ids)
        cap = asyncio.Semaphore(self.max_inflight or len(prompt_ids))

        async def one(i):
            async with cap:  # the client's cap on in-flight requests
                self._inflight += 1
                self.inflight_peak = max(self.inflight_peak, self._inflight)
                self._recent_peak = max(self._recent_peak, self._inflight)
                try:
                    return await self.client.client.completions(**request_body(
                        prompt_ids[i], model=name, n=n, max_tokens=max_new_tokens,
                        temperature=temperature, seed=seeds[i], sampling=self.sampling))
                finally:
                    self._inflight -= 1

        for attempt in range(self.retries + 1):
            todo = [i for i, reply in enumerate(replies) if reply is None]
            results = await asyncio.gather(*(one(i) for i in todo), return_exceptions=True)
            for i, result in zip(todo, results, strict=True):
                if (isinstance(result, ServerError) and result.status in RETRY_STATUSES
                        and attempt < self.retries):
                    self.retried += 1
                elif isinstance(result, BaseException):
                    raise result
                else:
                    replies[i] = result
            if all(reply is not None for reply in replies):
                return replies
            await asyncio.sleep(self.retry_every_s)
        raise AssertionError("unreachable")

    def pop_inflight_peak(self) -> int:
        """The most requests in flight at once since the last call (the trainer logs it per
        step as `rollout/inflight_max`)."""
        peak, self._recent_peak = self._recent_peak, self._inflight
        return peak

    def generate(self, prompt_ids, *, version, num_generations, max_new_tokens,
                 temperature) -> Completions:
        name = self.name(version)
        # The shape: G copies of each prompt with n = 1, or each prompt once with n = G.
        copies, n = ((num_generations, 1) if self.request_shape == "single"
                     else (1, num_generations))
        requests = [list(p) for p in prompt_ids for _ in range(copies)]  # prompt-major
        with self._lock:
            seeds = [self._rng.getrandbits(63) for _ in requests]  # one per request: G differ
        try:
            replies = self.client.call(self._generate(
                requests, name, n, max_new_tokens, temperature, seeds))
        except ServerError as exc:
            if exc.status == 404 and exc.param == "model":
                raise KeyError(f"policy version {version} ({name}) is not loaded on the "
                               f"server: {exc.message}") from exc
            raise
        return Completions.from_choices(replies)  # prompt-major: by prompt, then child

    def close(self) -> None:
        self.client.close()


# --- Before sampling: do the replicas serve the base model?
# Before a trainer samples from inference servers: do they serve its base model?
#
# An adapter trained on one base model means nothing on another, yet a replica started with another
# `--model` of the same shape loads it and samples without complaint. `check_replicas` asks each
# replica's /v1/models (vLLM's model cards: the base model's `id`, the name requests use, and its
# `root`, the path or hub id it was loaded from; then one card per loaded adapter, `parent` = the
# base) and refuses to start when one names another base model than the trainer's:
#
#     check_replicas("http://127.0.0.1:8000", "Qwen/Qwen3-0.6B")   # {replica: its base card}
#
# Behind `grpo-lab proxy` (its /proxy/stats lists the replicas) every replica is asked directly; one
# this process cannot reach (an HF Jobs replica wants the token the proxy adds) is reported, not
# guessed at. The proxy's own /v1/models answer names the replica it came from.


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
    it, `model_path` where it loads it from (grpo_lab.train.trainer's
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

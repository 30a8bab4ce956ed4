"""`grpo-lab serve`: a small stand-in for `vllm serve`, speaking the same HTTP contract.

    grpo-lab serve tiny --enable-lora --max-lora-rank 8 --max-loras 4 \\
        --logprobs-mode processed_logprobs --port 8000

Routes, status codes, error bodies and gates (VLLM_SERVER_DEV_MODE,
VLLM_ALLOW_RUNTIME_LORA_UPDATING) follow docs/serving-api.md, which also lists where it differs
from vLLM (tests/test_server_contract.py checks both engines). Parts (grpo_lab.serve.*):
engine (continuous batching), lora_registry (adapters), prefix_cache, protocol (parsing and
checks: sizes before work, finite float32 numbers), config (`ServeConfig`, the flags); below the
app, /server_info and /metrics, and the serving loop of the process (it exits if the engine
dies).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import traceback
from dataclasses import asdict

from aiohttp import web

from .batch import RequestGroup, Sequence, make_generator
from .config import ServeConfig
from .engine import Engine
from .lora_registry import LoRARegistry, read_adapter
from .prefix_cache import PrefixCache
from .process import READY_MARKER, serve_until_signalled
from .protocol import (
    RequestError,
    bearer_ok,
    chat_choice,
    check_prompt,
    completion_choice,
    completion_response,
    model_card,
    parse_chat_request,
    parse_completion_request,
    read_json_body,
)


def _gate(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true")


def _json(data, status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


class InferenceServer:
    """The model, the engine, the adapters, and the aiohttp application in front of them."""

    def __init__(self, config: ServeConfig, model=None, tokenizer=None):
        import torch

        from ..model.models import load_model_and_tokenizer, model_folder
        from ..util.devices import cap_gpu_memory

        self.config = config
        if config.threads():  # asked for, or the CPU's 1; a GPU's process keeps torch's own
            torch.set_num_threads(config.threads())
        path = model_folder(config.model)
        self.device = config.torch_device()
        cap_gpu_memory(self.device, config.gpu_memory_utilization)  # replicas sharing a GPU
        if model is None:
            model, tokenizer = load_model_and_tokenizer(path, dtype=config.torch_dtype())
        model = model.to(self.device)  # a model passed in keeps its own dtype
        self.model_path, self.tokenizer = path, tokenizer
        self.base_name = config.served_model_name or config.model
        self.dtype = next(model.parameters()).dtype
        derived = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = config.max_model_len or derived
        if self.max_model_len > derived:
            raise ValueError(f"max_model_len {self.max_model_len} is greater than the derived "
                             f"max_model_len {derived} (max_position_embeddings)")
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        self.lora = (LoRARegistry(model, config.max_loras, config.max_lora_rank,
                                  max_cpu_loras=config.max_cpu_loras)
                     if config.enable_lora else None)
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.engine = Engine(model, eos_token_ids=eos if isinstance(eos, list) else [eos],
                             max_model_len=self.max_model_len,
                             logprobs_mode=config.logprobs_mode,
                             max_num_seqs=config.max_num_seqs,
                             max_num_batched_tokens=config.max_num_batched_tokens, lora=self.lora,
                             prefix_cache=PrefixCache(config.block_size,
                                                      config.prefix_cache_max_blocks)
                             if config.enable_prefix_caching else None)
        self.api_key = config.api_key or os.environ.get("VLLM_API_KEY") or None
        self.dev_mode = _gate("VLLM_SERVER_DEV_MODE")
        self.runtime_lora = _gate("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        # A token's text is at most this many characters (its vocabulary entry is as long or
        # longer): a text prompt beyond max_model_len x this x 4 (normalizers may shrink text)
        # cannot fit, and is refused without tokenizing it.
        self.max_prompt_chars = 4 * self.max_model_len * max(
            map(len, tokenizer.get_vocab()), default=1)

    # ------------------------------------------------------------------ app and middlewares

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_request_bytes,
                              middlewares=[self._errors, self._auth])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        if self.dev_mode:
            app.router.add_get("/server_info", self.server_info)
            app.router.add_get("/get_world_size", self.world_size)
            app.router.add_post("/pause", self.pause)
            app.router.add_post("/resume", self.resume)
            app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        if self.runtime_lora:
            app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.on_startup.append(lambda _: self._start_engine())
        app.on_cleanup.append(lambda _: self._stop_engine())
        return app

    async def _start_engine(self) -> None:
        if not self.engine.started:
            self.engine.start()

    async def _stop_engine(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)

    @web.middleware
    async def _errors(self, request, handler):
        """Every failure becomes the body a vLLM client expects; the server stays up."""
        try:
            return await handler(request)
        except RequestError as exc:
            return _json(exc.as_body(), exc.status)
        except web.HTTPRequestEntityTooLarge as exc:
            message = (f"The request body is larger than the server's limit of "
                       f"{self.config.max_request_bytes} bytes ({exc.text}).")
            return _json(RequestError(message, 413).as_body(), 413)
        except web.HTTPException as exc:  # FastAPI's bodies for routing errors
            if exc.status in (404, 405):
                return _json({"detail": {404: "Not Found", 405: "Method Not Allowed"}[exc.status]},
                             exc.status)
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug or a dead engine: 500, never a crash
            traceback.print_exc()
            return _json(RequestError(f"{type(exc).__name__}: {exc}", 500).as_body(), 500)

    @web.middleware
    async def _auth(self, request, handler):
        if self.api_key and request.path != "/health":
            if not bearer_ok(request.headers.get("Authorization"), self.api_key):
                return _json({"error": "Unauthorized"}, 401)
        return await handler(request)


    # ------------------------------------------------------------------ routes

    async def health(self, request):
        return web.Response(status=200 if self.engine.alive else 503)

    async def models(self, request):
        data = [model_card(self.base_name, self.model_path, None, self.max_model_len,
                           self.created)]
        for adapter in self.lora.adapters() if self.lora else []:
            data.append(model_card(adapter.name, adapter.path, self.base_name, None,
                                   int(adapter.loaded_at)))
        return _json({"object": "list", "data": data})

    def vllm_config(self) -> dict:
        return vllm_config(self)

    async def server_info(self, request):
        fmt = request.query.get("config_format", "text")
        if fmt not in ("text", "json"):
            raise RequestError(f"config_format must be 'text' or 'json', got {fmt!r}.",
                               param="config_format")
        config = self.vllm_config()
        return _json({"vllm_config": config if fmt == "json" else str(config)})

    async def world_size(self, request):
        """Processes of the engine (tensor x pipeline parallel): one, as /server_info says."""
        return _json({"world_size": 1})

    async def pause(self, request):
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            raise RequestError(f"mode must be one of 'abort', 'wait', 'keep', got {mode!r}.",
                               param="mode")
        await asyncio.wrap_future(self.engine.pause(mode))
        return _json({"status": "paused"})

    async def resume(self, request):
        self.engine.resume()
        return _json({"status": "resumed"})

    async def metrics(self, request):
        return web.Response(body=prometheus_text(self).encode(),
                            headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})

    async def reset_prefix_cache(self, request):
        if self.engine.prefix_cache is not None:  # blocks are copies: running rows keep theirs
            self.engine.prefix_cache.reset()
        return web.Response(status=200)

    def _forget_cached_blocks(self, name: str) -> None:
        """A name loaded again or unloaded: its cached KV belongs to other weights."""
        if self.engine.prefix_cache is not None:
            self.engine.prefix_cache.drop(name)

    async def load_lora_adapter(self, request):
        body = await read_json_body(request)
        body = body if isinstance(body, dict) else {}
        name, path = body.get("lora_name"), body.get("lora_path")
        inplace = body.get("load_inplace", False)
        for key, value in (("lora_name", name), ("lora_path", path)):
            if value is not None and not isinstance(value, str):
                raise RequestError(f"'{key}' must be a string.", param=key)
        if not isinstance(inplace, bool):
            raise RequestError("'load_inplace' must be a boolean.", param="load_inplace")
        if not name or not path:
            raise RequestError("Both 'lora_name' and 'lora_path' must be provided.", 400,
                               "InvalidUserInput")
        if name == self.base_name:
            raise RequestError(f"The lora adapter '{name}' conflicts with a served base model.",
                               400, "InvalidUserInput")
        if self.lora is None:
            raise RequestError("LoRA is not enabled. Use --enable-lora to enable LoRA.", 500)
        if name in self.lora and not inplace:
            raise RequestError(f"The lora adapter '{name}' has already been loaded. If you want "
                               "to load the adapter in place, set 'load_inplace' to True.", 400,
                               "InvalidUserInput")
        adapter = await self._read_adapter(name, path)
        self.lora.add(adapter, replace=inplace)
        self._forget_cached_blocks(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _read_adapter(self, name: str, path: str, lag_s: float | None = None):
        lag = self.config.adapter_visibility_lag_s if lag_s is None else lag_s
        return await asyncio.get_running_loop().run_in_executor(None, lambda: read_adapter(
            name, path, module_shapes=self.lora.module_shapes,
            max_lora_rank=self.config.max_lora_rank, dtype=self.dtype, device=self.device,
            allowed_root=self.config.allowed_lora_root, visibility_lag_s=lag))

    async def _resident(self, adapter):
        """An adapter whose weights max_cpu_loras evicted is read again from its path."""
        if adapter.weights:
            return adapter
        try:
            self.lora.restore(await self._read_adapter(adapter.name, adapter.path, 0.0))
        except RequestError as exc:
            raise RequestError(f"The lora adapter '{adapter.name}' was evicted from memory "
                               f"(max_cpu_loras={self.lora.max_cpu_loras}) and cannot be read "
                               f"again from {adapter.path}: {exc.message}", 500) from exc
        return self.lora.get(adapter.name) or adapter

    async def unload_lora_adapter(self, request):
        body = await read_json_body(request)
        name = body.get("lora_name") if isinstance(body, dict) else None
        if name is not None and not isinstance(name, str):
            raise RequestError("'lora_name' must be a string.", param="lora_name")
        if not name:
            raise RequestError("'lora_name' needs to be provided to unload a LoRA adapter.", 400,
                               "InvalidUserInput")
        if self.lora is None or self.lora.remove(name) is None:
            raise RequestError(f"The lora adapter '{name}' cannot be found.", 404)
        self._forget_cached_blocks(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    async def completions(self, request):
        req = parse_completion_request(await read_json_body(request), self.config.max_logprobs)
        return await self._complete(req, completion_choice, chat=False)

    async def chat_completions(self, request):
        """A conversation rendered with the model's chat template (with the assistant's turn
        opened), then sampled as /v1/completions samples a prompt."""
        req, messages = parse_chat_request(await read_json_body(request),
                                           self.config.max_logprobs)
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(f"The model `{self.base_name}` has no chat template: use "
                               "/v1/completions with a prompt.", param="messages")
        ids = await asyncio.to_thread(self.tokenizer.apply_chat_template, messages,
                                      add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5: a BatchEncoding
            ids = ids["input_ids"]
        req.prompts = [list(ids)]
        return await self._complete(req, chat_choice, chat=True)

    async def _complete(self, req, make_choice, chat: bool):
        adapter = None
        if req.model and req.model != self.base_name:
            adapter = self.lora.get(req.model) if self.lora else None
            if adapter is None:
                raise RequestError(f"The model `{req.model}` does not exist.", 404,
                                   param="model")
            adapter = await self._resident(adapter)
        limit = 16 * self.config.max_num_seqs  # a bound on memory, far above any real request
        if len(req.prompts) * req.params.n > limit:
            raise RequestError(f"The request asks for {len(req.prompts) * req.params.n} "
                               f"completions (prompts x n); the limit is {limit}.", param="n")
        texts = [p for p in req.prompts if isinstance(p, str)]
        for text in texts:  # sizes before work: never tokenize what cannot fit
            if len(text) > self.max_prompt_chars:
                raise RequestError(f"The prompt ({len(text)} characters) is longer than the "
                                   f"maximum model length of {self.max_model_len} tokens.",
                                   param="prompt")
        if texts:  # in a worker thread: a long text must not stall the event loop
            encoded = iter((await asyncio.to_thread(
                self.tokenizer, texts, add_special_tokens=req.add_special_tokens))["input_ids"])
        prompt_ids = [p if isinstance(p, list) else next(encoded) for p in req.prompts]
        sequences = []
        for ids in prompt_ids:
            max_tokens = check_prompt(ids, req.max_tokens, self.max_model_len, self.vocab_size)
            for i in range(req.params.n):
                seed = None if req.params.seed is None else req.params.seed + i
                params = {**vars(req.params), "max_tokens": max_tokens, "seed": seed}
                sequences.append(Sequence(list(ids), type(req.params)(**params), adapter,
                                          make_generator(seed, self.engine.device)))
        loop = asyncio.get_running_loop()
        group = RequestGroup(sequences, loop, loop.create_future())
        self.engine.submit(group)
        try:
            await group.future
        except asyncio.CancelledError:  # the client went away: stop decoding its rows
            self.engine.cancel(group)
            raise
        choices = [make_choice(i, s, self.token_text,
                               self.tokenizer.decode(s.output_ids, skip_special_tokens=True),
                               req.return_token_ids) for i, s in enumerate(sequences)]
        return _json(completion_response(req.model or self.base_name, choices,
                                         sum(map(len, prompt_ids)),
                                         sum(len(s.output_ids) for s in sequences), chat=chat))


# ------------------------------------------------------------ as a process
# `grpo-lab serve` as a process: serve until SIGTERM or Ctrl-C, or until the engine dies.
#
# A server whose engine thread died can generate nothing: it exits with status 1 so that its
# supervisor (a job, a launcher) sees it and restarts it, instead of answering 503 forever.


async def engine_death(engine: Engine, poll_s: float = 0.2) -> BaseException | None:
    """Returns once the engine thread is dead: the exception that killed it, if any."""
    while engine.alive:
        await asyncio.sleep(poll_s)
    return engine.error


async def serve_forever(server: InferenceServer) -> int:
    """Serve until SIGTERM or Ctrl-C (returns 0) or until the engine dies (returns 1: a process
    that can generate nothing must end, so that its supervisor sees it and restarts it)."""
    runner = web.AppRunner(server.build_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, server.config.host, server.config.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"{READY_MARKER} http://{server.config.host}:{port} model={server.base_name} "
          f"lora={server.config.enable_lora} dev_mode={server.dev_mode} "
          f"runtime_lora_updating={server.runtime_lora}", flush=True)
    serving = asyncio.ensure_future(serve_until_signalled(runner))
    death = asyncio.ensure_future(engine_death(server.engine))
    await asyncio.wait([serving, death], return_when=asyncio.FIRST_COMPLETED)
    if serving.done():
        death.cancel()
        serving.result()
        return 0
    print(f"grpo-lab serve: the engine died ({death.result()!r}); exiting", file=sys.stderr,
          flush=True)
    serving.cancel()  # serve_until_signalled closes the runner on its way out
    await asyncio.gather(serving, return_exceptions=True)
    return 1


def serve(config: ServeConfig) -> None:
    """Load the model and serve until SIGTERM or Ctrl-C; exit with status 1 if the engine dies."""
    if config.threads():  # asked for, or the CPU's 1; on a GPU torch keeps its own
        os.environ.setdefault("OMP_NUM_THREADS", str(config.threads()))
    server = InferenceServer(config)
    print(f"grpo-lab serve: model {server.model_path} ({server.dtype} on {server.device}), "
          f"max_model_len {server.max_model_len}, logprobs_mode {config.logprobs_mode}",
          file=sys.stderr, flush=True)
    code = asyncio.run(serve_forever(server))
    if code:
        sys.exit(code)


# ------------------------------------------------------------ what it says about itself
# What `grpo-lab serve` says about itself: /server_info's config and /metrics' counters.
#
# `vllm_config` is the body of `GET /server_info`: the parts of vLLM's config that clients read,
# plus a `grpo_lab` key (flags, engine and prefix-cache counters). `prometheus_text` is
# `GET /metrics` with vLLM's names and labels. Both: docs/serving-api.md, "Endpoints" and
# "Prefix caching in grpo-lab serve".


PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

COUNTERS = (  # (name, help as vLLM writes it, where grpo-lab serve counts it)
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     "queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "hits"),
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
     "cached_prompt_tokens"),
    ("vllm:generation_tokens", "Number of generation tokens processed.", "generated_tokens"),
)


def prefix_cache_stats(server) -> dict | None:
    cache = server.engine.prefix_cache
    return cache.stats() if cache is not None else None


def peak_gpu_memory(device: str) -> int | None:
    """Most bytes torch has held on this GPU at once (None on the CPU)."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.max_memory_allocated(device)


def vllm_config(server) -> dict:
    cfg = server.config
    lora = None
    if cfg.enable_lora:
        lora = {"max_lora_rank": cfg.max_lora_rank, "max_loras": cfg.max_loras,
                "max_cpu_loras": server.lora.max_cpu_loras if server.lora else None,
                "lora_dtype": "auto", "fully_sharded_loras": False}
    return {
        "model_config": {"model": server.model_path, "served_model_name": server.base_name,
                         "tokenizer": server.model_path, "dtype": str(server.dtype),
                         "max_model_len": server.max_model_len,
                         "max_logprobs": cfg.max_logprobs, "logprobs_mode": cfg.logprobs_mode},
        "cache_config": {"block_size": cfg.block_size,
                         "enable_prefix_caching": cfg.enable_prefix_caching},
        "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1,
                            "pipeline_parallel_size": 1},
        "scheduler_config": {"max_num_seqs": cfg.max_num_seqs,
                             "max_num_batched_tokens": cfg.max_num_batched_tokens,
                             "max_model_len": server.max_model_len},
        "device_config": {"device": server.device},
        "lora_config": lora,
        "grpo_lab": {"engine": dict(server.engine.stats), "paused": server.engine.paused,
                     "prefix_cache": prefix_cache_stats(server),
                     "peak_gpu_memory_bytes": peak_gpu_memory(server.device),
                     **{k: v for k, v in asdict(cfg).items() if k != "api_key"}},
    }


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(server) -> str:
    """The counters above, then grpo_lab's gauge of cached blocks, in Prometheus' text format."""
    counts = dict(server.engine.stats)
    cache = prefix_cache_stats(server)
    counts.update(queries=cache["queries"] if cache else 0, hits=cache["hits"] if cache else 0)
    labels = f'{{model_name="{_label(server.base_name)}",engine="0"}}'
    lines = []
    for name, help_text, key in COUNTERS:
        lines += [f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter",
                  f"{name}_total{labels} {float(counts[key])}"]
    lines += ["# HELP grpo_lab:prefix_cache_blocks KV blocks held by the prefix cache.",
              "# TYPE grpo_lab:prefix_cache_blocks gauge",
              f"grpo_lab:prefix_cache_blocks{labels} {float(cache['blocks'] if cache else 0)}"]
    return "\n".join(lines) + "\n"

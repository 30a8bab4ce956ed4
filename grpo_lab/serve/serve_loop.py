"""`grpo-lab serve` as a process: serve until SIGTERM or Ctrl-C, or until the engine dies.

A server whose engine thread died can generate nothing: it exits with status 1 so that its
supervisor (a job, a launcher) sees it and restarts it, instead of answering 503 forever.
"""

from __future__ import annotations

import asyncio
import os
import sys

from aiohttp import web

from .config import ServeConfig
from .engine import Engine
from .process import READY_MARKER, serve_until_signalled
from .server import InferenceServer


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

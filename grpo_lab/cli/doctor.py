"""`grpo-lab doctor RUN_DIR`: read a finished or running run folder and print what is wrong.

It reads the trainer's `metrics.jsonl` (and `config.json`, for max_staleness and the sampler
correction; `syncs.jsonl`, for the last adapter version published) and runs the run doctor
(grpo_lab.watch.doctor, with the pipeline's bottleneck) over it. With `--server-url` (a replica,
or the proxy in front of several) it also asks each replica's `/v1/models` whether it serves
the last published adapter: a replica that never loaded it answers under the base model's name
only.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def add_parser(sub) -> None:
    doctor = sub.add_parser("doctor", help="name what is silently wrong in a run folder")
    doctor.add_argument("run_dir", help="a run folder with metrics.jsonl")
    doctor.add_argument("--server-url", default=None,
                        help="a replica or the proxy: ask the replicas which adapters they serve")
    doctor.add_argument("--adapter-prefix", default="policy",
                        help="the adapters' name prefix (train-async's --adapter-prefix)")
    doctor.add_argument("--api-key-file", default=None, type=Path,
                        help="a file holding the replicas'/proxy's bearer token (default: "
                             "$VLLM_API_KEY); never the key itself in argv, where the process "
                             "list shows it")
    doctor.add_argument("--api-key", default=None, help=argparse.SUPPRESS)  # refused in `run`
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")
    doctor.set_defaults(func=run)


def replica_adapter_findings(server_url: str, adapter: str, api_key: str | None = None):
    """Findings for each replica (behind the proxy at `server_url`, or `server_url` itself) whose
    /v1/models does not list `adapter`."""
    from ..rollout.http_generator import fetch_json, proxy_replicas
    from ..watch.doctor import Finding

    def fetch(url):
        return fetch_json(url, api_key=api_key, timeout_s=5.0)

    replicas = proxy_replicas(server_url.rstrip("/"), fetch) or [server_url.rstrip("/")]
    findings = []
    for replica in replicas:
        try:
            models, _ = fetch(replica + "/v1/models")
        except (OSError, ValueError) as exc:
            findings.append(Finding("replica_unreachable", f"could not ask {replica}", 0,
                                    {"replica": replica, "error": str(exc)[:120]},
                                    "the replica is down or not reachable from here",
                                    "check its job and its exposed port", "every replica answers"))
            continue
        served = [c.get("id") for c in models.get("data", [])] if isinstance(models, dict) else []
        if adapter not in served:
            findings.append(Finding(
                "adapter_not_loaded", "a replica does not serve the trainer's adapter", 0,
                {"replica": replica, "expected": adapter, "served": ", ".join(map(str, served))},
                "the adapter never reached this replica (the bucket's mount, a failed load), so "
                "requests under the adapter's name get the base model or fail",
                "check the replica's log for the load, the bucket mount, and --enable-lora",
                "every replica lists the newest published adapter"))
    return findings


def diagnose_run(run_dir: str | Path, server_url: str | None = None,
                 adapter_prefix: str = "policy", api_key: str | None = None) -> list:
    """Every finding for a run folder (the doctor over its records, then the replicas)."""
    from ..bucket.adapters import adapter_name
    from ..util.files import read_jsonl
    from ..watch.doctor import pipeline_doctor

    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: not a run folder (or the run "
                                "has not logged a step yet)")
    config = {}
    if (run_dir / "config.json").is_file():
        config = json.loads((run_dir / "config.json").read_text())
    correction = "tis" if config.get("vllm_importance_sampling_correction") else "none"
    asynchronous = "max_staleness" in config or any(
        "version" in r for r in read_jsonl(metrics)[:3])
    doctor = pipeline_doctor(correction=correction,
                    max_staleness=config.get("max_staleness", 1) if asynchronous else None)
    findings = doctor.read(read_jsonl(metrics))
    syncs = read_jsonl(run_dir / "syncs.jsonl") if (run_dir / "syncs.jsonl").is_file() else []
    if server_url and syncs:
        adapter = adapter_name(int(syncs[-1]["version"]), adapter_prefix)
        findings += replica_adapter_findings(server_url, adapter, api_key)
    return findings


def api_key(args) -> str | None:
    """The bearer token from --api-key-file, else $VLLM_API_KEY; a key given in argv is refused
    (anyone on the machine reads it in the process list)."""
    if args.api_key is not None:
        raise SystemExit("grpo-lab doctor: --api-key would show the key in the process list: "
                         "set VLLM_API_KEY, or put the key in a file and pass --api-key-file")
    if args.api_key_file is None:
        return os.environ.get("VLLM_API_KEY")
    try:
        key = args.api_key_file.read_text().strip()
    except OSError as exc:
        raise SystemExit(f"grpo-lab doctor: cannot read --api-key-file: {exc}") from None
    if not key:
        raise SystemExit(f"grpo-lab doctor: --api-key-file {args.api_key_file} is empty")
    return key


def run(args) -> int:
    findings = diagnose_run(args.run_dir, args.server_url, args.adapter_prefix, api_key(args))
    problems = [f for f in findings if f.kind == "problem"]
    if args.json:
        print(json.dumps([f.as_dict() for f in findings], indent=2))
        return 1 if problems else 0
    for finding in sorted(findings, key=lambda f: f.kind == "problem"):  # notes first
        print(finding.text())
    if not problems:
        print(f"{args.run_dir}: no findings")
    return 1 if problems else 0

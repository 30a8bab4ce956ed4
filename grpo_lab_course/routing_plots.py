"""Which replica served each request behind the proxy, read from its answers, and drawn (notebook
06).

    client = BlockingClient(proxy.url)
    answer, replica = completion_served_by(client, {url_a: "A", url_b: "B"}, prompt=ids)
    runs = compare_routings(replica_urls, "tiny", prompts, group_size=4)  # affinity, round-robin
    plot_routing_runs(runs); plot_placement(placement); plot_rollout_routing(replay_run)
    per_replica = replica_ratios(answers, policy, base_model, pad_id)  # which replica is off

Also one-line views of the router's decisions, a replay run, a prompt's blocks, the two
routings' gap, a replica's adapters (`describe_decision`, `replay_line`, `show_blocks`,
`routing_gap`, `adapters_on`).

The proxy names the replica(s) of every answer in its `X-Proxy-Upstream` header; the replicas'
prefix-cache counters and the router's counters come from `routing_runs.routing_run`.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from grpo_lab.serve.client import BlockingClient, InferenceClient, ServerError
from grpo_lab_course.routing_runs import ROUTINGS, routing_run

KIND_COLOURS = {"affinity": "#009E73", "spill": "#E69F00", "unmatched": "#999999"}
"""The router's three kinds of decision, in colour-blind-safe colours (Okabe-Ito)."""


def upstream_names(header: str, names: dict[str, str] | None = None) -> str:
    """`X-Proxy-Upstream` ("url1,url2") as short names ("A,B"); unknown urls stay urls."""
    names = names or {}
    return ",".join(names.get(u, u) for u in header.split(",") if u)


async def _post(client: InferenceClient, path: str, body: dict) -> tuple[dict, str]:
    _, text, headers = await client.request_with_headers("POST", path, json_body=body)
    return json.loads(text), headers.get("X-Proxy-Upstream", "")


def completion_served_by(client: BlockingClient, names: dict[str, str] | None = None, *,
                         prompt, max_tokens: int = 4, temperature: float = 1.0,
                         logprobs: int | None = 0, **fields) -> tuple[dict, str]:
    """POST /v1/completions through a proxy (`prompt`: token ids or a list of them; `fields` as
    `InferenceClient.completions`) -> (the answer's JSON, the replica(s) that served it, by
    `names`). A non-2xx answer raises `ServerError`."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "n": 1,
            "logprobs": logprobs, "return_token_ids": True, **fields}
    answer, header = client.call(_post(client.client, "/v1/completions", body))
    return answer, upstream_names(header, names)


def load_status(client: BlockingClient, name: str, path: str) -> tuple[int, str]:
    """Load an adapter through the proxy -> (status, message): 200 and the answer, or the error's
    status and message (the proxy answers 200 only once every replica has it)."""
    try:
        return 200, client.load_lora_adapter(name, str(path))
    except ServerError as err:
        return err.status, err.message


def compare_routings(replica_urls: list[str], model: str, prompts: list[list[int]], *,
                     start_replica: Callable | None = None, extra_replicas: int = 0,
                     **kwargs) -> dict[str, dict]:
    """`routing_run` with each of ROUTINGS on the same prompts, from cold caches. With
    `extra_replicas` > 0, that many more replicas are started with `start_replica()` (a
    `ServerProcess`) for the comparison and stopped after it. `kwargs` go to `routing_run`."""
    started = [start_replica() for _ in range(extra_replicas)]
    try:
        urls = [*replica_urls, *(s.url for s in started)]
        return {routing: routing_run(urls, model, prompts, routing=routing, **kwargs)
                for routing in ROUTINGS}
    finally:
        for server in started:
            server.stop()


def plot_rollout_routing(run: dict):
    """Figure: of a `routing_replay.replay` run, how the rollouts at each index within their group
    were routed (stacked bars: affinity, spill, unmatched). Returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    bottom = [0] * run["group_size"]
    for kind, colour in KIND_COLOURS.items():
        counts = run["by_rollout_index"][kind]
        ax.bar(range(run["group_size"]), counts, bottom=bottom, color=colour, label=kind)
        bottom = [b + c for b, c in zip(bottom, counts)]
    ax.set(xlabel="rollout index within its group (0 = first)", ylabel="requests",
           title="How each rollout of a group was routed")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)  # beside the bars
    fig.tight_layout()
    return fig


def plot_placement(placement: dict[str, list[str]]):
    """Figure: one row per prompt, one cell per request of its group, coloured by the replica
    that served it (`placement`: prompt -> replica names in the order sent)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    replicas = sorted({r for served in placement.values() for r in served})
    grid = [[replicas.index(r) for r in served] for served in placement.values()]
    colours = ["#0072B2", "#E69F00", "#CC79A7", "#56B4E9"][:len(replicas)]
    fig, ax = plt.subplots(figsize=(1.2 + 0.7 * max(map(len, grid)), 0.45 * len(grid) + 1))
    ax.imshow(grid, cmap=ListedColormap(colours), vmin=-0.5, vmax=len(replicas) - 0.5,
              aspect="auto")
    for i, served in enumerate(placement.values()):
        for j, replica in enumerate(served):
            dark = replicas.index(replica) == 0  # white on blue, black on the lighter colours
            ax.text(j, i, replica, ha="center", va="center", color="white" if dark else "black",
                    weight="bold")
    ax.set(yticks=range(len(grid)), yticklabels=list(placement), xlabel="request of the group",
           xticks=range(max(map(len, grid))), title="Replica that served each request")
    fig.tight_layout()
    return fig


def plot_routing_runs(runs: dict[str, dict], title: str = ""):
    """Figure: per routing of `compare_routings`, the replicas' prefix-cache hit rate, the prompt
    tokens they computed, and the run's seconds. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(10, 2.8))
    names = list(runs)
    for ax, key, label in zip(axes, ("prefix_cache_hit_rate", "prefill_tokens_computed",
                                     "seconds"),
                              ("prefix-cache hit rate", "prefill tokens computed",
                               "seconds (noisy)")):
        ax.bar(names, [runs[n][key] for n in names], color=["#009E73", "#999999"][:len(names)])
        ax.set_title(label)
    axes[0].set_ylim(0, 1)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def adapters_on(url: str) -> list[str]:
    """The adapters (models with a parent) one replica has loaded, asked of it directly."""
    with BlockingClient(url) as replica_client:
        return [m["id"] for m in replica_client.models() if m["parent"]]


def describe_decision(d) -> str:
    """One router decision (`PrefixRouter.route`'s answer) in one line: replica, kind, matches."""
    return (f"replica {d.replica}  {d.kind:9}  specific match {d.specific_match_blocks}  "
            f"common prefix {d.common_prefix_blocks} of {d.prompt_blocks} blocks")


def replay_line(run: dict) -> str:
    """A `routing_replay.replay` run's counts and routing shares, in two lines."""
    return (f"{run['rollouts']:,} rollouts, {run['syncs']} adapter versions, routed "
            f"{run['routed']}\naffinity {run['affinity_pct']} %  spill {run['spill_pct']} %  "
            f"unmatched {run['unmatched_pct']} %  (floor 1/G = {run['unmatched_floor_pct']} %)")


def show_blocks(tokenizer, ids: list[int], template_tokens: int, block: int = 16) -> None:
    """Print a prompt's blocks of `block` tokens: the template's, the problem's own, the tail."""
    for i in range(0, len(ids), block):
        part = "template" if i + block <= template_tokens else "the problem's own"
        part = part if i + block <= len(ids) else "tail: in no full block, never cached"
        end = min(i + block, len(ids)) - 1
        print(f"tokens {i:2}-{end:2}  {tokenizer.decode(ids[i:i + block])!r:22} {part}")


def routing_gap(runs: dict[str, dict]) -> tuple[float, float]:
    """Print each routing's counters of `compare_routings`, then return (and print) affinity's
    prefix-cache hit rate minus round-robin's and its prefill tokens over round-robin's."""
    for routing, cold in runs.items():
        print(routing, {k: cold[k] for k in ("prompt_tokens", "cached_prompt_tokens",
                                             "prefill_tokens_computed", "seconds", "router")})
    aff, rr = runs["affinity"], runs["round-robin"]
    gap = aff["prefix_cache_hit_rate"] - rr["prefix_cache_hit_rate"]
    ratio = aff["prefill_tokens_computed"] / rr["prefill_tokens_computed"]
    print(f"hit rate: affinity - round-robin = {gap:+.3f}; "
          f"prefill tokens computed: affinity / round-robin = {ratio:.2f}")
    return gap, ratio


def replica_ratios(answers: list[tuple[dict, str]], policy, base_model,
                   pad_id: int) -> dict[str, dict[str, float]]:
    """The per-token ratio pi_policy / pi_served of completions (`answers`: (answer, replica) of
    `completion_served_by`), split by the replica that served each: per metric, per replica,
    the samples, the ratio's mean, k3, max |ratio - 1|, and max |ratio - 1| against
    `base_model` instead of `policy`. Prints one line per replica."""
    import torch

    from grpo_lab.algo.logprobs import policy_logprobs
    from grpo_lab.algo.sampler_correction import sampler_kl
    from grpo_lab_course.ratio_stats import collate_choices

    served_by = [replica for _, replica in answers]
    b = collate_choices([answer["choices"][0] for answer, _ in answers], pad_id)
    args = (b["p_ids"], b["p_mask"], b["c_ids"], b["c_mask"])
    with torch.no_grad():  # the trainer's logprobs of the same tokens, (B, T)
        trainer, base = policy_logprobs(policy, *args), policy_logprobs(base_model, *args)
    ratio, base_ratio = torch.exp(trainer - b["served"]), torch.exp(base - b["served"])
    out = {key: {} for key in ("samples", "mean", "k3", "deviation", "base_deviation")}
    for name in sorted(set(served_by)):
        rows = torch.tensor([r == name for r in served_by])  # the completions it served
        real = b["c_mask"].bool() & rows[:, None]
        out["samples"][name] = int(rows.sum())
        out["mean"][name] = float(ratio[real].mean())
        out["k3"][name] = sampler_kl(trainer[rows], b["served"][rows], b["c_mask"][rows])
        out["deviation"][name] = float((ratio[real] - 1).abs().max())
        out["base_deviation"][name] = float((base_ratio[real] - 1).abs().max())
        print(f"replica {name}: {out['samples'][name]:2} samples  ratio mean "
              f"{out['mean'][name]:.4f}  k3 {out['k3'][name]:.1e}  max |ratio - 1| "
              f"{out['deviation'][name]:.4f}  | against the base model: max |ratio - 1| "
              f"{out['base_deviation'][name]:.2e}")
    return out

"""KV-prefix affinity routing: send each completion to the replica that already caches its prompt.

`PrefixRouter` imitates vLLM's chained block hashes to remember which replica served which
prefix, and routes a prompt to the replica with the longest prompt-specific cached prefix unless
it is more than `imbalance` requests busier than the least loaded. Pure bookkeeping, no I/O:
the proxy calls `route` before forwarding and `finish` when the answer ends. The rules and the
load guard: docs/recipe.md, "The proxy"; the counters: docs/serving-api.md, "What
`GET /proxy/stats` counts".
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from ..serve.block_hashes import DEFAULT_BLOCK_SIZE, chained_block_hashes
from ..serve.protocol import RequestError, parse_prompts

RouteKind = Literal["affinity", "spill", "unmatched"]
RECENT_PROMPT_TOKENS = 1 << 18
"""`route` keeps the block hashes of the most recent (adapter, prompt) pairs, up to this many
prompt tokens in all (about 10 MB): a GRPO group's G rollouts share one prompt and arrive within
a step's requests, so all but the first skip the hashing."""


@dataclass(kw_only=True)  # keyword-only: ProxyConfig inherits these after its own positional ones
class RouterConfig:
    """Knobs of the prefix router (the reference proxy's `PROXY_*` settings). `grpo-lab proxy`
    takes them as flags: ProxyConfig inherits these fields."""

    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per KV block; must match the server's block size (vLLM: 16). Only full blocks
    count."""
    imbalance: int = 12
    """How many in-flight requests the preferred replica may be ahead of the least-loaded one
    before a request spills to the least-loaded replica instead. About 1.5 G for G rollouts per
    prompt (docs/recipe.md, "The proxy"); the reference proxy's 8 spills ~1 % at G = 8."""
    max_tracked_blocks: int = 500_000
    """Cap on the block table; the least recently used blocks are forgotten beyond it."""
    routing: str = "affinity"
    """"affinity" (prefix first, then load) or "round-robin" (next up replica, prefixes ignored)."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.imbalance < 0:
            raise ValueError(f"imbalance must be >= 0, got {self.imbalance}")
        if self.max_tracked_blocks < 1:
            raise ValueError(f"max_tracked_blocks must be >= 1, got {self.max_tracked_blocks}")
        if self.routing not in ("affinity", "round-robin"):
            raise ValueError(f"routing must be 'affinity' or 'round-robin', got {self.routing!r}")


@dataclass(frozen=True)
class RouteDecision:
    """Where one request went and why."""

    replica: str
    """Name of the chosen replica."""
    kind: RouteKind
    """"affinity", "spill" or "unmatched" (docs/serving-api.md, "What `GET /proxy/stats`
    counts")."""
    specific_match_blocks: int
    """Longest prompt-specific cached prefix any up replica had (0 when unmatched); for a spill,
    that of the replica it did not go to."""
    common_prefix_blocks: int
    """Leading blocks that were common (shared template, or cached everywhere)."""
    prompt_blocks: int
    """Full blocks in the prompt (a trailing partial block is ignored)."""
    cached_everywhere: bool = False
    """Every up replica cached the prompt past its shared template, so no replica had a
    specific match and the least-loaded one got it as a cache hit (kind "affinity")."""


class NoReplicaAvailable(RuntimeError):
    """Raised by `route` when every replica is marked down."""


class _Block:
    """One tracked block: who served it and which blocks followed it (at most two kept)."""

    __slots__ = ("owners", "successors")

    def __init__(self) -> None:
        self.owners = 0  # bitmask over replica indices
        self.successors: tuple[int, ...] = ()  # up to 2 distinct: 2 already means "branch point"


class PrefixRouter:
    """Routes prompts to replicas by KV-prefix affinity, with a load guard and an LRU block
    table."""

    def __init__(self, replicas: Sequence[str] | int, config: RouterConfig | None = None):
        if isinstance(replicas, int):
            if replicas < 1:
                raise ValueError(f"need at least one replica, got {replicas}")
            replicas = [f"replica-{i}" for i in range(replicas)]
        self.replicas: list[str] = list(replicas)
        if not self.replicas:
            raise ValueError("need at least one replica")
        if len(set(self.replicas)) != len(self.replicas):
            raise ValueError(f"replica names must be distinct, got {self.replicas}")
        self.config = config or RouterConfig()
        n = len(self.replicas)
        self._table: OrderedDict[int, _Block] = OrderedDict()  # hash -> block, oldest first
        self._up = [True] * n
        self._inflight = [0] * n
        self._routed = [0] * n
        self._kinds = {"affinity": 0, "spill": 0, "unmatched": 0}
        self._evicted = 0
        self._everywhere = 0  # affinity requests whose prompt every up replica cached
        self._rr = 0  # where ties between equally loaded replicas start looking
        self._recent: dict[tuple, list[int]] = {}  # (adapter, prompt) -> hashes, oldest first
        self._recent_tokens = 0  # prompt tokens in `_recent`'s keys

    # ---- hashing -------------------------------------------------------------------------------

    def block_hashes(self, token_ids: Sequence[int], adapter_name: str) -> list[int]:
        """Chained hashes of the prompt's full blocks: h1 = H(seed, b1), h2 = H(h1, b2), ...

        The seed is derived from the adapter name, so the same tokens under `policy-v3` and
        `policy-v4` share no hash (vLLM keeps the adapter in every block's extra keys). The
        servers' prefix caches key their blocks with the same function
        (grpo_lab.serve.block_hashes).
        """
        return chained_block_hashes(token_ids, adapter_name, self.config.block_size)

    def _recent_hashes(self, token_ids: Sequence[int], adapter_name: str) -> list[int]:
        """`block_hashes`, remembered for the most recent prompts (RECENT_PROMPT_TOKENS)."""
        key = (adapter_name, tuple(token_ids))
        hashes = self._recent.get(key)
        if hashes is None:
            hashes = self._recent[key] = self.block_hashes(token_ids, adapter_name)
            self._recent_tokens += len(key[1])
            while self._recent_tokens > RECENT_PROMPT_TOKENS:  # forget the oldest
                oldest = next(iter(self._recent))
                del self._recent[oldest]
                self._recent_tokens -= len(oldest[1])
        return hashes

    # ---- routing -------------------------------------------------------------------------------

    def route(self, token_ids: Sequence[int], adapter_name: str,
              avoid: Collection[str] = ()) -> RouteDecision:
        """Choose a replica for one prompt, record it as an owner of the prompt's blocks, and
        count the request as in flight there (call `finish` when its response ends). Replicas
        in `avoid` (they just refused this request) are chosen only if no other is up."""
        up = [i for i, ok in enumerate(self._up) if ok]
        if not up:
            raise NoReplicaAvailable(f"all replicas are marked down: {self.replicas}")
        if avoid:
            up = [i for i in up if self.replicas[i] not in avoid] or up
        up_mask = sum(1 << r for r in up)
        hashes = self._recent_hashes(token_ids, adapter_name)
        get = self._table.get
        blocks = [get(h) for h in hashes]

        # Stage 1: the common prefix. A block is common if it has more than one successor (this
        # prompt's next block counts): a shared template; or if every up replica served it.
        # Hashes are chained, so every block before a common block is common too (a template
        # longer than one block branches only at its last block). Common blocks say nothing
        # about placement. `branch` counts the template part only.
        # Stage 2, in the same pass: each replica's leading matched blocks. `alive` holds the up
        # replicas that served every block so far; a replica's run ends where its bit drops.
        common = branch = seen = 0
        matched = dict.fromkeys(up, 0)
        alive, last = up_mask, len(hashes) - 1
        for i, block in enumerate(blocks):
            if block is None:
                break
            successors = block.successors  # up to 2 distinct; this prompt's next block counts
            if len(successors) == 2 or (successors and i < last
                                        and successors[0] != hashes[i + 1]):
                common = branch = i + 1
            elif block.owners & up_mask == up_mask:
                common = i + 1
            if alive & ~block.owners:
                for r in up:
                    if alive >> r & 1 and not block.owners >> r & 1:
                        matched[r] = i
                alive &= block.owners
            seen = i + 1
        matched.update((r, seen) for r in up if alive >> r & 1)  # matched every block seen
        # minus the common prefix = each replica's specific match
        specific = {r: m - common if m > common else 0 for r, m in matched.items()}
        best_match = max(specific.values())

        # Stage 3: affinity if the best replica is not too far ahead in load, else spill
        # (round-robin routing: the next replica in turn, and the counters say how that went)
        everywhere = False
        round_robin = self.config.routing == "round-robin"  # the turn decides, not the cache
        if best_match > 0 and round_robin:
            pick = self._next_in_turn(up)
            kind = "affinity" if specific[pick] == best_match else "spill"
        elif best_match > 0:
            inflight = self._inflight
            best = self._least_loaded([r for r in up if specific[r] == best_match])
            if inflight[best] - min([inflight[r] for r in up]) <= self.config.imbalance:
                pick, kind = best, "affinity"
            else:
                pick, kind = self._least_loaded(up), "spill"
        else:
            # Nobody has a specific match: least loaded. If every up replica caches this prompt
            # past its template (it spilled earlier), the pick is a cache hit all the same: count
            # it as affinity, flagged, where the reference proxy counts it as unmatched.
            pick = self._next_in_turn(up) if round_robin else self._least_loaded(up)
            everywhere = min(matched.values()) > branch
            kind = "affinity" if everywhere else "unmatched"

        # Stage 4: bookkeeping. The pick now caches every block of the prompt.
        self._record(hashes, blocks, pick)
        self._rr = (pick + 1) % len(self.replicas)  # round-robin pointer: after the last pick
        self._inflight[pick] += 1
        self._routed[pick] += 1
        self._kinds[kind] += 1
        self._everywhere += everywhere
        return RouteDecision(self.replicas[pick], kind, best_match, common, len(hashes), everywhere)

    def finish(self, replica: str | int) -> None:
        """A response from `replica` ended (success or error): one fewer request in flight."""
        r = self._index(replica)
        if self._inflight[r] == 0:
            raise ValueError(f"finish({self.replicas[r]!r}) with no request in flight there")
        self._inflight[r] -= 1

    def mark_down(self, replica: str | int, forget: bool = True) -> None:
        """Never route to `replica` until `mark_up`. With `forget`, drop it from every block's
        owners too: a replica that died restarts with an empty prefix cache."""
        r = self._index(replica)
        self._up[r] = False
        if forget:
            keep = ~(1 << r)
            for block in self._table.values():
                block.owners &= keep

    def mark_up(self, replica: str | int) -> None:
        """Route to `replica` again."""
        self._up[self._index(replica)] = True

    def stats(self) -> dict:
        """Counters for logs and dashboards (docs/serving-api.md, "What `GET /proxy/stats`
        counts")."""
        total = sum(self._routed)

        def pct(count: int) -> float:
            return round(100.0 * count / total, 2) if total else 0.0

        return {
            "replicas": list(self.replicas),
            "up": list(self._up),
            "requests": total,
            "routed": list(self._routed),
            "inflight": list(self._inflight),
            "affinity": self._kinds["affinity"],
            "spilled": self._kinds["spill"],
            "unmatched": self._kinds["unmatched"],
            "affinity_pct": pct(self._kinds["affinity"]),
            "spill_pct": pct(self._kinds["spill"]),
            "unmatched_pct": pct(self._kinds["unmatched"]),
            "cached_everywhere": self._everywhere,
            # the reference proxy labels cached-everywhere requests unmatched
            "unmatched_reference_pct": pct(self._kinds["unmatched"] + self._everywhere),
            "tracked_blocks": len(self._table),
            "evicted": self._evicted,
        }

    def summary(self) -> str:
        """One log line in the reference proxy's shape: `routed [..] affinity .. spilled ..`."""
        s = self.stats()
        return (
            f"routed {s['routed']} affinity {s['affinity']} spilled {s['spilled']} "
            f"unmatched {s['unmatched']} inflight {s['inflight']} tracked {s['tracked_blocks']}"
        )

    # ---- internals -----------------------------------------------------------------------------

    def _index(self, replica: str | int) -> int:
        if isinstance(replica, int):
            if not 0 <= replica < len(self.replicas):
                raise KeyError(f"no replica with index {replica}")
            return replica
        try:
            return self.replicas.index(replica)
        except ValueError:
            raise KeyError(f"unknown replica {replica!r}; known: {self.replicas}") from None

    def _least_loaded(self, candidates: list[int]) -> int:
        """Fewest requests in flight among `candidates`; ties go round robin: to the first one
        after the last replica picked, so equally loaded replicas take turns."""
        inflight, rr, n = self._inflight, self._rr, len(self.replicas)
        return min(candidates, key=lambda r: (inflight[r], (r - rr) % n))

    def _next_in_turn(self, candidates: list[int]) -> int:
        """The first of `candidates` after the last replica picked (round-robin routing)."""
        rr, n = self._rr, len(self.replicas)
        return min(candidates, key=lambda r: (r - rr) % n)

    def _record(self, hashes: list[int], blocks: list[_Block | None], pick: int) -> None:
        """Mark `pick` as an owner of every block (`blocks`: the table's entries for `hashes`,
        None where new) and link each block to its successor; used blocks move to the LRU end."""
        table = self._table
        move_to_end = table.move_to_end
        owner = 1 << pick
        last = len(hashes) - 1
        for i, h in enumerate(hashes):
            block = blocks[i]
            if block is None:
                block = table[h] = _Block()
            else:
                move_to_end(h)  # most recently used last
            block.owners |= owner
            if i < last:
                nxt = hashes[i + 1]
                successors = block.successors
                if len(successors) < 2 and nxt not in successors:
                    block.successors = successors + (nxt,)
        while len(table) > self.config.max_tracked_blocks:
            table.popitem(last=False)  # forget the least recently used block
            self._evicted += 1


# ------------------------------------------------------------ what it routes on
# The token ids of each prompt in a completion request. The router needs token ids, and
# requests carry them in one of vLLM's prompt forms: a list of ids, a list of id lists (a batch),
# a string, a list of strings, or chat messages. Ids are used as they are. Text is tokenized
# with the proxy's `--tokenizer` when one is given (with the chat template for messages);
# without one, the proxy routes on pseudo-tokens: the UTF-8 bytes (chat: the messages as sorted
# JSON) cut into 4-byte chunks, about one token each in English text. Pseudo-blocks do not line
# up with the server's KV blocks, but prompts that share a long prefix share their leading
# pseudo-blocks, and that is what affinity needs.
#
# A body that no replica could ever accept (no prompt, an empty one, a wrong type) raises the
# server's `RequestError` (grpo_lab.serve.protocol, the same prompt rules), so the proxy answers
# 400 at once without a round trip.


TEXT_BYTES_PER_TOKEN = 4  # pseudo-tokens of text prompts: 4 UTF-8 bytes each


def pseudo_tokens(text: str) -> list[int]:
    """Text as routing keys without a tokenizer: one int per 4 UTF-8 bytes (a partial tail is
    dropped, as a partial KV block would be)."""
    data = text.encode()
    return memoryview(data)[: len(data) - len(data) % TEXT_BYTES_PER_TOKEN].cast("I").tolist()


def routing_keys(body: dict, chat: bool, tokenizer=None) -> tuple[list, list[list[int]]]:
    """-> (the prompts, the token ids to route each one on)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("Field required: 'messages' (a non-empty list).", param="messages")
        if tokenizer is not None:
            try:
                ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=(
                    body.get("add_generation_prompt", True)))
                return [messages], [list(ids["input_ids"] if hasattr(ids, "keys") else ids)]
            except Exception:  # the replica will judge the messages; route on their bytes
                pass
        return [messages], [pseudo_tokens(json.dumps(messages, sort_keys=True))]
    if "prompt" not in body:
        raise RequestError("Field required: 'prompt'.", param="prompt")
    prompts = parse_prompts(body["prompt"])
    if tokenizer is None:
        return prompts, [p if isinstance(p, list) else pseudo_tokens(p) for p in prompts]
    special = body.get("add_special_tokens", True) is not False
    return prompts, [p if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=special)
                     for p in prompts]

"""Names for KV blocks: the chained hash of a prompt's full blocks (vLLM's prefix-cache keys).

h_1 = H(seed(namespace), block 1), h_i = H(h_{i-1}, block i): h_i names the whole prefix ending
at block i, under one adapter (the namespace). The server's prefix cache and the proxy's router
both use it (docs/serving-api.md, "Prefix-cache hashing").
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block by default, as vLLM's `--block-size`: the server's prefix cache and the
proxy's router (and so every config that sets either) take theirs from here."""
SEED_DOMAIN = b"grpo_lab/prefix-cache-seed\x00"
DIGEST_SIZE = 8  # 64-bit hashes: collisions are negligible at 500,000 tracked blocks


def chained_block_hashes(token_ids: Sequence[int], namespace: str, block_size: int) -> list[int]:
    """Hashes of the prompt's full blocks: h1 = H(seed, b1), h2 = H(h1, b2), ...

    `namespace`: the adapter's name, "" for the base model (it seeds the chain).
    """
    n_blocks = len(token_ids) // block_size  # the last partial block is never cached
    data = array("q", token_ids[: n_blocks * block_size]).tobytes()  # 8 bytes per token id
    step = block_size * 8
    prev_digest = hashlib.blake2b(SEED_DOMAIN + namespace.encode(),
                                  digest_size=DIGEST_SIZE).digest()  # h0 = seed(namespace)
    hashes = []
    for i in range(n_blocks):
        # h_i names the whole prefix up to block i: it hashes h_{i-1} with block i's tokens
        prev_digest = hashlib.blake2b(prev_digest + data[i * step: (i + 1) * step],
                                      digest_size=DIGEST_SIZE).digest()
        hashes.append(int.from_bytes(prev_digest, "little"))
    return hashes

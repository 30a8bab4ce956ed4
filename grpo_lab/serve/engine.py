"""Continuous batching: one engine thread decodes every active request together, step by step.

Between decode steps the engine admits waiting sequences (a prefill, below),
decodes one token for every running row, samples each row with its own parameters
(grpo_lab.serve.sampling) and retires finished rows, so no request waits for the longest one
in its batch. The HTTP server submits `RequestGroup`s and awaits their futures. The loop, the
running batch and the device rules: docs/internals.md, "Continuous batching".
"""

from __future__ import annotations

import concurrent.futures
import inspect
import threading

import torch
from transformers import DynamicCache

from .batch import RequestGroup, RunningBatch, Sequence
from .lora_registry import LoRARegistry
from .prefix_cache import PrefixCache, PrefixMatch, assemble_prefixes, cut_blocks
from .sampling import sample

# --- Prefill: the first forward over admitted prompts
# Prefill: the engine's first forward over newly admitted prompts, reusing cached prefixes.
#
# Each prompt's longest cached run of full blocks (grpo_lab.serve.prefix_cache) is handed to the
# forward as past keys and values, and only the rest of the prompt is computed, its positions
# continuing from the cached length. Copies of one prompt admitted together are prefilled in waves,
# so that the later ones read the blocks the first one computed (docs/internals.md, "Prefill and
# the prefix cache").


class Prefill:
    """The prefill half of `Engine` (a mixin); see the module docstring."""

    prefix_cache: PrefixCache | None
    device: torch.device
    stats: dict

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Prefill the admitted sequences, in waves when a prefix cache is on."""
        if self.prefix_cache is None:
            self._prefill_wave([(s, None) for s in seqs])
            return
        while seqs:
            wave, seqs = self._next_wave(seqs)
            self._prefill_wave(wave)

    def _next_wave(self, seqs: list[Sequence]) -> tuple[list, list[Sequence]]:
        """-> (sequences to prefill now with their cache matches, sequences to prefill after)."""
        wave, later, computing = [], [], set()
        for seq in seqs:
            found = self.prefix_cache.match(seq.prompt_ids, seq.adapter.name if seq.adapter
                                            else "", seq.adapter_key)
            usable = (len(seq.prompt_ids) - 1) // self.prefix_cache.block_size
            upcoming = found.keys(len(found.blocks))  # full blocks this sequence would compute
            if len(found.blocks) < usable and upcoming[0] in computing:
                later.append(seq)  # an earlier row computes its next block: read it next wave
                continue
            computing.update(upcoming)
            wave.append((seq, found))
        return wave, later

    def _prefill_wave(self, wave: list[tuple[Sequence, PrefixMatch | None]]) -> None:
        """One forward over the uncached part of each prompt; sample the first tokens; cache the
        new full blocks; merge the rows into the running batch."""
        wave = sorted(wave, key=lambda pair: pair[0].adapter_key)  # LoRA: one slice per adapter
        seqs = [seq for seq, _ in wave]
        cached = [found.cached_tokens if found else 0 for _, found in wave]
        for (seq, found), c in zip(wave, cached, strict=True):
            seq.num_cached_tokens = c
            if found is not None:
                self.prefix_cache.use(found)
        suffixes = [seq.prompt_ids[c:] for seq, c in zip(seqs, cached, strict=True)]
        P, T = max(cached), max(map(len, suffixes))  # past columns, new columns
        ids = torch.tensor([[0] * (T - len(x)) + x for x in suffixes], device=self.device)
        mask = torch.tensor([[0] * (P - c) + [1] * c + [0] * (T - len(x)) + [1] * len(x)
                             for c, x in zip(cached, suffixes, strict=True)], device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, P:]  # continue from the cached length
        past = DynamicCache()
        if P:
            past = DynamicCache(ddp_cache_data=assemble_prefixes(
                [found.blocks if found else [] for _, found in wave], P))
        logits, cache = self._forward(seqs, ids, mask, positions, past)
        self.stats["prefills"] += 1
        self.stats["prompt_tokens"] += sum(len(s.prompt_ids) for s in seqs)
        self.stats["cached_prompt_tokens"] += sum(cached)
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        if self.prefix_cache is not None:
            self._cache_new_blocks(wave, kv, P + T)
        for s in seqs:
            if s.params.repetition_penalty != 1.0:
                s.seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=self.device)
                s.seen[torch.tensor(s.prompt_ids, device=self.device)] = True
        tokens = self._sample_and_record(seqs, logits)
        alive = [i for i, s in enumerate(seqs) if s.finish_reason is None]
        if not alive:
            return
        index = torch.tensor(alive, device=self.device)
        new_kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in kv]
        self._merge([seqs[i] for i in alive], new_kv, mask.index_select(0, index),
                    tokens.index_select(0, index))

    def _cache_new_blocks(self, wave, kv, width: int) -> None:
        """Copy each prompt's newly computed full blocks into the prefix cache."""
        bs = self.prefix_cache.block_size
        for row, (seq, found) in enumerate(wave):
            n_new = len(found.hashes) - len(found.blocks)
            if n_new:  # the suffix ends at column `width`; its first token is prompt token c
                start = width - (len(seq.prompt_ids) - found.cached_tokens)
                self.prefix_cache.insert(found, cut_blocks(kv, row, start, n_new, bs))


PAUSE_MODES = ("abort", "wait", "keep")


class Engine(Prefill, RunningBatch):
    """Owns the model; `submit` request groups from any thread; `start` runs the loop thread."""

    def __init__(self, model, *, eos_token_ids: list[int], max_model_len: int,
                 logprobs_mode: str = "raw_logprobs", max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, lora: LoRARegistry | None = None,
                 prefix_cache: PrefixCache | None = None):
        self.model = model.eval()
        self.device = next(model.parameters()).device  # every tensor of the batch lives here
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.logprobs_mode = logprobs_mode
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lora = lora
        self.max_loras = lora.max_loras if lora is not None else 0
        self.prefix_cache = prefix_cache  # None: every prompt is prefilled whole
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # Shared with other threads, guarded by _cond.
        self._cond = threading.Condition()
        self._waiting: list[Sequence] = []  # admissible now, FIFO
        self._held: list[Sequence] = []  # arrived while paused: admitted on resume
        self._state = "running"  # "running", "draining" (pause mode wait) or "paused"
        self._abort_pending = False
        self._pause_futures: list[concurrent.futures.Future] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        # Owned by the engine thread: the running batch (rows, KV cache, mask, next tokens).
        self._reset_batch()
        self.stats = dict(steps=0, prefills=0, generated_tokens=0, max_batch=0, prompt_tokens=0,
                          cached_prompt_tokens=0)  # prefilled = prompt - cached

    # ------------------------------------------------------------------ API (any thread)

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def paused(self) -> bool:
        return self._state != "running"

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name="grpo-lab-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, group: RequestGroup) -> None:
        """Queue a request's sequences; their generators must be on `self.device`
        (`make_generator(seed, engine.device)`)."""
        for seq in group.sequences:
            if seq.generator.device.type != self.device.type:
                raise ValueError(f"a sequence's generator is on {seq.generator.device}, the "
                                 f"engine on {self.device}: make_generator(seed, engine.device)")
        with self._cond:
            if self.error is not None:
                raise RuntimeError(f"the engine is dead: {self.error!r}")
            (self._waiting if self._state == "running" else self._held).extend(group.sequences)
            self._cond.notify_all()

    def cancel(self, group: RequestGroup) -> None:
        """Abort a request (its client went away): its rows are dropped before the next step."""
        with self._cond:
            group.cancelled = True
            self._cond.notify_all()

    def pause(self, mode: str = "abort") -> concurrent.futures.Future:
        """Resolves once paused. abort: finish in-flight requests now with finish_reason "abort";
        wait: let in-flight requests finish; keep: freeze them until `resume`. New requests are
        accepted in every mode and wait for `resume`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self.error is not None:  # a dead engine generates nothing: paused already
                self._state = "paused"
                future.set_result(False)
                return future
            if mode == "wait":
                if self._state == "running":
                    self._state = "draining"
            else:
                self._state = "paused"
                self._abort_pending |= mode == "abort"
            self._pause_futures.append(future)
            self._cond.notify_all()
        return future

    def resume(self) -> None:
        with self._cond:
            self._state = "running"
            self._waiting.extend(self._held)
            self._held.clear()
            self._resolve_pause_futures()
            self._cond.notify_all()

    # ------------------------------------------------------------------ the loop (engine thread)

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self._cond:
                        admitted = self._wait_for_work()
                        if admitted is None:
                            return
                    self._drop_cancelled()
                    if admitted:
                        self._prefill(admitted)
                    if self._rows:
                        self._decode_step()
        except BaseException as exc:  # the engine is dead: fail every request, /health says 503
            self.error = exc
            with self._cond:
                pending = self._rows + self._waiting + self._held
                self._waiting, self._held, self._rows = [], [], []
            for group in {id(s.group): s.group for s in pending if s.group}.values():
                group.error = RuntimeError(f"the engine failed: {exc!r}")
                group.resolve()
            raise

    def _wait_for_work(self) -> list[Sequence] | None:
        """Under the lock: handle pause requests, sleep while idle, pick sequences to admit."""
        while True:
            if self._stopping:
                return None
            if self._abort_pending:
                self._abort_pending = False
                for seq in self._rows + self._waiting:
                    self._finish(seq, "abort")
                self._rows, self._waiting = [], []
                self._reset_batch()
            if self._state == "draining" and not self._rows and not self._waiting:
                self._state = "paused"
            if self._state == "paused":
                self._resolve_pause_futures()
            elif self._rows or self._waiting:
                return self._take_admissible()
            self._cond.wait()

    def _resolve_pause_futures(self) -> None:
        for future in self._pause_futures:
            if not future.done():
                future.set_result(True)
        self._pause_futures.clear()

    def _take_admissible(self) -> list[Sequence]:
        """FIFO admission within max_num_seqs rows, max_loras adapters, and a prefill token cap."""
        admitted, rest = [], []
        adapters = {s.adapter_key for s in self._rows if s.adapter is not None}
        tokens = 0
        for seq in self._waiting:
            room = len(self._rows) + len(admitted) < self.max_num_seqs
            fits = (seq.adapter is None or seq.adapter_key in adapters
                    or len(adapters) < self.max_loras)
            small = not admitted or tokens + len(seq.prompt_ids) <= self.max_num_batched_tokens
            if room and fits and small and not seq.group.cancelled:
                admitted.append(seq)
                tokens += len(seq.prompt_ids)
                if seq.adapter is not None:
                    adapters.add(seq.adapter_key)
            elif seq.group.cancelled:
                self._finish(seq, "abort")
            else:
                rest.append(seq)
        self._waiting = rest
        return admitted

    def _drop_cancelled(self) -> None:
        keep = [i for i, s in enumerate(self._rows) if not s.group.cancelled]
        if len(keep) < len(self._rows):
            for s in self._rows:
                if s.group.cancelled:
                    self._finish(s, "abort")
            self._select_rows(keep)

    def _forward(self, rows, input_ids, attention_mask, position_ids, cache):
        """(B, T) ids -> (B, V) logits of the last position, with each row's adapter."""
        if self.lora is not None:
            self.lora.segments = self._segments(rows)
        try:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids, use_cache=True, logits_to_keep=1,
                             **{self._cache_kw: cache})
        finally:
            if self.lora is not None:
                self.lora.segments = []
        new_cache = getattr(out, "cache", None)
        return out.logits[:, -1, :], new_cache if new_cache is not None else out.past_key_values

    # ------------------------------------------------------------------ prefill and decode

    def _decode_step(self) -> None:
        """Feed every running row its last sampled token; sample the next; retire finished rows."""
        mask = self._decode_columns()  # (B, L + 1): one more real column per row
        positions = mask.sum(-1, keepdim=True) - 1  # (B, 1): each row's own position
        logits, self._cache = self._forward(self._rows, self._next.unsqueeze(1), mask, positions,
                                            self._cache)
        self.stats["steps"] += 1
        self._next = self._sample_and_record(self._rows, logits)
        keep = [i for i, s in enumerate(self._rows) if s.finish_reason is None]
        if len(keep) < len(self._rows):
            self._select_rows(keep)

    def _sample_and_record(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        out = sample(logits, [s.params for s in seqs], [s.generator for s in seqs],
                     [s.seen for s in seqs], self.logprobs_mode)
        tokens, logprobs = out.tokens.tolist(), out.logprobs.tolist()
        self.stats["generated_tokens"] += len(tokens)
        for row, (seq, token, logprob) in enumerate(zip(seqs, tokens, logprobs, strict=True)):
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            k = seq.params.logprobs
            if k:  # the top k of this position (the sampled token is added by the server)
                values, ids = out.logprob_rows[row].topk(min(k, logits.shape[-1]))
                seq.top_logprobs.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
            if seq.seen is not None:
                seq.seen[token] = True
            p = seq.params
            if token in self.eos_token_ids and not p.ignore_eos:
                self._finish(seq, "stop")
            elif token in p.stop_token_ids:
                self._finish(seq, "stop", stop_reason=token)
            elif (len(seq.output_ids) >= p.max_tokens
                  or len(seq.prompt_ids) + len(seq.output_ids) >= self.max_model_len):
                self._finish(seq, "length")
        return out.tokens

    def _finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        if seq.finish_reason is not None:
            return
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.group is not None:
            seq.group.sequence_finished()


def generate_sync(engine: Engine, sequences: list[Sequence],
                  timeout: float = 600) -> list[Sequence]:
    """Submit sequences to a started engine from a plain thread and wait (tests, benchmarks)."""
    done = threading.Event()

    class _Group(RequestGroup):
        def resolve(self):
            done.set()

    group = _Group(sequences)
    engine.submit(group)
    if not done.wait(timeout):
        engine.cancel(group)
        raise TimeoutError(f"generation did not finish in {timeout} s")
    if group.error is not None:
        raise group.error
    return sequences

"""What one GRPO step holds in memory, in bytes, term by term, for a Qwen2-style model.

    persistent   weights (+ fp32 master copies of the trained ones in bfloat16) + AdamW's state
    training     gradients + activations kept for the backward + the LM head's logits
    generation   the KV cache + one position's logits per row
    total        persistent + max(training, generation): sampling and the update take turns

The terms, per parameter (Rajbhandari et al. 2020, ZeRO, section 3.1: mixed-precision Adam holds
2 + 2 + 12 bytes per parameter):
- float32: weights 4 bytes; a trained parameter adds a float32 gradient (4) and AdamW's two
  float32 moments (8).
- bfloat16 with float32 master weights: weights 2 bytes; a trained parameter adds a bfloat16
  gradient (2), a float32 master copy (4) and the moments (8): 16 bytes, ZeRO's count.
- LoRA of rank r on every linear layer (peft's "all-linear": q, k, v, o, gate, up, down; not the
  LM head) trains r x (in + out) parameters per layer, in `adapter_dtype` (peft makes adapters
  float32 by default), with their gradients and moments; the base weights stay frozen.

Activations, per layer and per token (`layer_activation_bytes`): the tensors autograd saves in
transformers' Qwen2DecoderLayer with sdpa attention and no dropout, counted by hand and checked
against `torch.autograd.graph.saved_tensors_hooks` on small Qwen2 models (tests/
test_memory_model.py: exact in float32 and bfloat16, full and LoRA). With e the weights' bytes,
h hidden, kv = KV heads x head_dim, i intermediate:

    2 RMSNorms   2 x (4h + 4), + 2 x e h when their weights train (they compute in float32)
    attention    e (h + 2 kv + h) + 4 heads    (q, k, v after RoPE, the output, logsumexp)
    MLP          3 e i                         (gate, SiLU(gate), up)
    linear inputs  e (2h + i) when the base trains or adapters share its dtype (the q/k/v input,
                 the gate/up input, the down input); float32 adapters on bfloat16 weights cast
                 each adapted layer's input apart: 4 (6h + i); LoRA adds 7 r x adapter bytes

It is the same accounting as Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", 34 s b h + 5 a s^2 b bytes per GPT layer in fp16 with dropout), for SwiGLU,
grouped-query attention, RMSNorm and a fused attention kernel (no s x s scores kept). With
activation checkpointing each layer keeps only its input (e h per token) and one layer's
activations exist again during its backward.

Logits: `positions x vocab x (e + 12)` bytes: the LM head's output and three float32 copies (the
logits / temperature, the log-softmax kept for the backward, its gradient), for every completion
position of a micro-batch at once, or a bounded chunk of positions (`logits_chunk_rows`).
Not modelled: the runtime itself (Python, torch, a CUDA context), allocator slack and
fragmentation, a dense 4-D attention mask (rows x L x L bytes, for padded or packed rows through
sdpa), temporaries inside a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB, GiB = 2**20, 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_STATE_BYTES = 8
"""AdamW's first and second moments, float32 each, per trained parameter."""
LOGITS_FLOAT32_COPIES = 3
"""Float32 (positions x vocab) tensors alive at the LM head's peak besides its own output."""
GENERATION_LOGITS_COPIES = 3
"""Float32 (rows x vocab) tensors per decoding step: the logits, the processed scores, the
sampling probabilities."""


@dataclass(frozen=True)
class StepSetting:
    """One GRPO step: the batch, the lengths, the precision, what trains."""

    prompts: int = 2
    """Distinct prompts per step."""
    num_generations: int = 8
    """G: completions per prompt; the step has prompts x G sequences (rows)."""
    prompt_tokens: int = 64
    """Prompt length (the longest, for padded rows)."""
    completion_tokens: int = 128
    """Completion length (max_new_tokens: random weights always reach it)."""
    dtype: str = "float32"
    """`float32`, or `bfloat16` weights with float32 master copies of the trained ones."""
    lora_rank: int | None = None
    """LoRA rank on every linear layer; None = full fine-tuning."""
    adapter_dtype: str = "float32"
    """The LoRA adapters' dtype (peft's default: float32 whatever the base's)."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass."""
    micro_batch_rows: int | None = None
    """Sequences per forward and backward (gradient accumulation); None = every row at once."""
    logits_chunk_rows: int | None = None
    """Positions whose logits exist at once (a chunked LM head); None = every completion
    position of a micro-batch."""
    generate_in_process: bool = True
    """The trainer samples the completions itself (False: separate inference servers, as in
    the blog's recipe; the KV cache is theirs)."""

    @property
    def rows(self) -> int:
        """Computed: sequences in the step, prompts x G."""
        return self.prompts * self.num_generations

    @property
    def sequence_tokens(self) -> int:
        """Computed: prompt + completion tokens of one sequence."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class StepMemory:
    """The bytes of each term of one step (see the module docstring), and their `total`."""

    label: str
    num_parameters: int
    trainable_parameters: int
    weights: int
    master_weights: int
    optimizer: int
    gradients: int
    activations: int
    logits: int
    kv_cache: int
    generation_logits: int

    @property
    def persistent(self) -> int:
        return self.weights + self.master_weights + self.optimizer

    @property
    def training(self) -> int:
        return self.gradients + self.activations + self.logits

    @property
    def generation(self) -> int:
        return self.kv_cache + self.generation_logits

    @property
    def total(self) -> int:
        """Peak bytes: what persists, plus the larger of the two phases."""
        return self.persistent + max(self.training, self.generation)

    def __str__(self) -> str:
        rows = [("weights", self.weights), ("master weights (fp32)", self.master_weights),
                ("optimizer (AdamW moments)", self.optimizer), ("gradients", self.gradients),
                ("activations", self.activations), ("logits", self.logits),
                ("KV cache (generation)", self.kv_cache),
                ("logits (generation)", self.generation_logits),
                ("= training phase", self.training), ("= generation phase", self.generation),
                ("total", self.total)]
        lines = [f"{self.label}: {self.num_parameters:,} parameters, "
                 f"{self.trainable_parameters:,} trained",
                 f"  {'term':<27}{'MiB':>12}{'GiB':>9}"]
        lines += [f"  {name:<27}{value / MiB:>12,.1f}{value / GiB:>9.2f}" for name, value in rows]
        return "\n".join(lines)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_linears(config) -> list[tuple[int, int]]:
    """(in, out) features of one decoder layer's linear layers: q, k, v, o, gate, up, down."""
    h, i = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * _head_dim(config)
    kv = config.num_key_value_heads * _head_dim(config)
    return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]


def num_parameters(config) -> int:
    """Parameters of a Qwen2 causal LM: embedding, layers (q/k/v with biases), norms, head."""
    h, V = config.hidden_size, config.vocab_size
    linears = layer_linears(config)
    biases = sum(out for _, out in linears[:3])  # Qwen2: q, k and v have biases
    layer = sum(a * b for a, b in linears) + biases + 2 * h  # + two RMSNorms
    head = 0 if config.tie_word_embeddings else V * h
    return V * h + config.num_hidden_layers * layer + h + head


def lora_parameters(config, rank: int) -> int:
    """Parameters of a rank-`rank` LoRA on every linear layer: A (r x in) and B (out x r)."""
    return config.num_hidden_layers * sum(rank * (a + b) for a, b in layer_linears(config))


def layer_activation_bytes(config, dtype: str = "float32", lora_rank: int | None = None,
                           adapter_dtype: str = "float32") -> int:
    """Bytes autograd keeps per token for one decoder layer's backward (module docstring)."""
    e, a = DTYPE_BYTES[dtype], DTYPE_BYTES[adapter_dtype]
    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * _head_dim(config)
    full = lora_rank is None
    norms = 2 * (4 * h + 4 + (e * h if full else 0))
    attention = e * (2 * h + 2 * kv) + 4 * config.num_attention_heads
    mlp = 3 * e * i
    if full or a == e:
        inputs = e * (2 * h + i)
    else:  # each adapted layer casts its input to the adapters' dtype: q, k, v, o, gate, up, down
        inputs = a * (6 * h + i)
    adapters = 0 if full else 7 * lora_rank * a  # the input of each lora_B
    return norms + attention + mlp + inputs + adapters


def step_memory(config, setting: StepSetting, label: str | None = None) -> StepMemory:
    """The memory of one step of `setting` for `config` (a ModelShape or a transformers config)."""
    s = setting
    e = DTYPE_BYTES[s.dtype]
    total_params = num_parameters(config)
    full = s.lora_rank is None
    trained = total_params if full else lora_parameters(config, s.lora_rank)
    train_bytes = e if full else DTYPE_BYTES[s.adapter_dtype]  # dtype of the trained weights
    weights = total_params * e + (0 if full else trained * train_bytes)
    master = trained * 4 if train_bytes < 4 else 0  # float32 copies of bfloat16 trained weights

    # Training: one micro-batch's activations and logits at a time; gradients for every one.
    h, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    rows = min(s.micro_batch_rows or s.rows, s.rows)
    tokens = rows * s.sequence_tokens
    per_layer = layer_activation_bytes(config, s.dtype, s.lora_rank, s.adapter_dtype)
    if s.activation_checkpointing:  # each layer's input, and one layer recomputed
        activations = L * e * h * tokens + per_layer * tokens
    else:
        activations = L * per_layer * tokens
    activations += (4 * h + 4 + (e * h if full else 0)) * tokens  # the final RMSNorm
    positions = rows * s.completion_tokens
    if full:
        activations += e * h * positions  # the head's input, for the (tied) head's gradient
    chunk = min(s.logits_chunk_rows or positions, positions)
    logits = chunk * V * (e + 4 * LOGITS_FLOAT32_COPIES)

    kv_cache = generation_logits = 0
    if s.generate_in_process:
        kv_per_token = L * 2 * config.num_key_value_heads * _head_dim(config) * e
        kv_cache = kv_per_token * s.rows * s.sequence_tokens
        generation_logits = s.rows * V * 4 * GENERATION_LOGITS_COPIES
    name = getattr(config, "name", None) or getattr(config, "model_type", "model")
    return StepMemory(
        label=label or name, num_parameters=total_params, trainable_parameters=trained,
        weights=weights, master_weights=master, optimizer=trained * ADAM_STATE_BYTES,
        gradients=trained * train_bytes, activations=activations, logits=logits,
        kv_cache=kv_cache, generation_logits=generation_logits)

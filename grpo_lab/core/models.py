"""Loading any causal LM and its tokenizer: a hub id, a local folder, or a built tiny/chat model.

Left padding (generation continues the prompt); a tokenizer without a pad token pads with EOS.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer


def load_model_and_tokenizer(model: str | Path, device: str = "cpu", dtype=None):
    """Load any causal LM (a hub id, a local path, or a tiny-model path) and its tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    kwargs = {"dtype": dtype} if dtype is not None else {}
    lm = AutoModelForCausalLM.from_pretrained(model, **kwargs).to(device)
    return lm, tokenizer

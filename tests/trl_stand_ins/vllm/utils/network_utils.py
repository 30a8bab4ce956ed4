"""Stand-in: only TRL's NCCL weight transfer calls these; the LoRA path never does."""


def _nccl_only(*args, **kwargs):
    raise RuntimeError("test stand-in for vllm: NCCL weight transfer is not available; "
                       "the trainer job syncs LoRA adapters over HTTP")


get_ip = get_open_port = _nccl_only

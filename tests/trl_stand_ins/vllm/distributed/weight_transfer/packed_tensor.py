"""Stand-in: the NCCL broadcast of TRL's merged-weight sync, never used by the LoRA path."""

from vllm.utils.network_utils import _nccl_only as packed_nccl_broadcast_producer  # noqa: F401

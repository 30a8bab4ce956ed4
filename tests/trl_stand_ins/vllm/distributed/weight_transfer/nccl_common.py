"""Stand-in: the NCCL rendezvous of TRL's merged-weight sync, never used by the LoRA path."""

from vllm.utils.network_utils import _nccl_only as trainer_init  # noqa: F401

"""Test-only stand-in for the `vllm` package (see tests/trl_stand_ins/README.md)."""

__version__ = "0.30.0"  # inside TRL 1.16's supported range (0.22.0-0.31.0): no warning

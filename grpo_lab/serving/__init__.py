"""Stage 4, serving: `grpo-lab serve`, a small stand-in for `vllm serve` with the same HTTP API
(on the CPU, or a CUDA GPU with `--device`).

The wire format (protocol), vLLM's sampling, the continuous-batching engine and its prefix cache,
several LoRA adapters on one model, the aiohttp server, its client, and starting it as a process.
Taught by notebook 05.
"""

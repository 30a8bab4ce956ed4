"""serve: `grpo-lab serve`, a small stand-in for `vllm serve` with the same HTTP API, and
real vLLM's CPU build as a process.

The wire format (`protocol`), vLLM's sampling and the sampling settings a run sends, the
continuous-batching engine and its prefix cache, several LoRA adapters on one model, the aiohttp
server, its client, and starting either server as a process. Taught by notebook 05.
"""

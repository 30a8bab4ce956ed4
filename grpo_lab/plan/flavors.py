"""Hugging Face Jobs' GPU flavors: memory, hourly price and speed of each, for the planner.

Where each figure comes from:
- names, GPUs, GPU memory and hourly prices: the Hugging Face Jobs pricing page
  (https://huggingface.co/docs/hub/jobs-pricing, whose source is huggingface/hub-docs
  docs/hub/jobs-pricing.md, commit 0b8c07f8210e1214ea5ce2fc4fbc2050d0b42e89), copied on
  PRICES_COPIED. Online, `flavors(refresh=True)` asks the Hub instead
  (`huggingface_hub.HfApi.list_jobs_hardware()`, `GET /api/jobs/hardware`), which lists the same
  names with a per-minute price and the GPU model; the speeds below are looked up by that model.
- GPU memory per GPU: the pricing table's "GPU Memory" (decimal GB, all GPUs of the flavor)
  divided by the GPUs and converted to GiB. A driver reports a little more for some (an H200:
  143,771 MiB, 140.4 GiB, against 131.3 here): the planner's memory check errs on the safe side.
- dense bf16 tensor TFLOP/s and memory bandwidth per GPU: NVIDIA's datasheets (the dense
  figure, half the "with sparsity" one), except where GPU_SPECS's notes say otherwise.
Exposed ports (each replica exposes one) add EXPOSED_PORT_USD_PER_H per job (the same page).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PRICES_SOURCE = ("Hugging Face Jobs pricing page, huggingface/hub-docs docs/hub/jobs-pricing.md "
                 "@ 0b8c07f8")
PRICES_COPIED = "2026-12-02"
EXPOSED_PORT_USD_PER_H = 0.01
"""A job that exposes a port pays this per hour on top of its hardware (the pricing page)."""
GB_AS_GIB = 1e9 / 2**30


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model's speed, per GPU (vendor datasheet)."""

    bf16_tflops: float
    """Dense bf16 tensor TFLOP/s (T4: fp16, it has no bf16)."""
    memory_bandwidth_gbs: float
    """Memory bandwidth, GB/s: what bounds a replica's decoding."""
    note: str = ""
    bf16: bool = True
    """Computes in bfloat16, the trainer's precision (T4: fp16 only, a replica, not a trainer)."""


GPU_SPECS = {
    "T4": GpuSpec(65, 320, "Tesla T4 datasheet: 65 fp16 TFLOP/s (no bf16: vLLM runs it in fp16)",
                  bf16=False),
    "L4": GpuSpec(121, 300, "L4 datasheet: 242 bf16 TFLOP/s with sparsity"),
    "L40S": GpuSpec(362, 864, "L40S datasheet: 362.05 bf16 TFLOP/s (733 with sparsity)"),
    "A10G": GpuSpec(70, 600, "AWS's variant of the A10, no NVIDIA datasheet: 70 TFLOP/s as "
                    "Baseten's A10 vs A10G comparison gives it (the A10's sheet: 125)"),
    "A100": GpuSpec(312, 2039, "A100 80GB SXM datasheet (PCIe: 1,935 GB/s)"),
    "H200": GpuSpec(989, 4800, "H200 SXM datasheet: 1,979 bf16 TFLOP/s with sparsity"),
    "RTX PRO 6000": GpuSpec(500, 1792, "RTX PRO 6000 Blackwell: 1,792 GB/s; NVIDIA publishes 4 "
                            "PFLOP/s fp4 with sparsity and no bf16 figure, so ~500 is derived "
                            "(fp4 -> bf16 halves twice, sparsity halves once), not published"),
}
"""Speed per GPU model, keyed as `list_jobs_hardware()` names the model (`accelerator.model`)."""


@dataclass(frozen=True)
class Flavor:
    """One HF Jobs hardware flavor."""

    name: str
    """As HF Jobs spells it (`h200x2`): `hf jobs run --flavor NAME`."""
    gpus: int
    gpu_model: str
    """A key of GPU_SPECS."""
    gpu_memory_gib: float
    """Per GPU (see the module docstring)."""
    hourly_usd: float
    """The whole flavor, per hour (billed by the minute)."""
    source: str = f"table of {PRICES_COPIED}"
    """Where the price came from: the committed table, or `hub` (list_jobs_hardware)."""

    @property
    def spec(self) -> GpuSpec:
        return GPU_SPECS[self.gpu_model]

    @property
    def peak_flops(self) -> float:
        """Dense bf16 FLOP/s of one GPU."""
        return self.spec.bf16_tflops * 1e12

    @property
    def memory_bandwidth(self) -> float:
        """Bytes/s of one GPU."""
        return self.spec.memory_bandwidth_gbs * 1e9

    @property
    def memory_bytes(self) -> float:
        return self.gpu_memory_gib * 2**30


def _flavor(name: str, gpus: int, model: str, total_gb: float, hourly_usd: float) -> Flavor:
    return Flavor(name, gpus, model, round(total_gb / gpus * GB_AS_GIB, 1), hourly_usd)


FLAVORS = {f.name: f for f in (
    # name, GPUs, GPU model, GPU memory (GB, whole flavor), hourly price (USD): the pricing page
    _flavor("t4-small", 1, "T4", 16, 0.40),
    _flavor("t4-medium", 1, "T4", 16, 0.60),
    _flavor("l4x1", 1, "L4", 24, 0.80),
    _flavor("l4x4", 4, "L4", 96, 3.80),
    _flavor("l40sx1", 1, "L40S", 48, 1.80),
    _flavor("l40sx4", 4, "L40S", 192, 8.30),
    _flavor("l40sx8", 8, "L40S", 384, 23.50),
    _flavor("a10g-small", 1, "A10G", 24, 1.00),
    _flavor("a10g-large", 1, "A10G", 24, 1.50),
    _flavor("a10g-largex2", 2, "A10G", 48, 3.00),
    _flavor("a10g-largex4", 4, "A10G", 96, 5.00),
    _flavor("a100-large", 1, "A100", 80, 2.50),
    _flavor("a100x4", 4, "A100", 320, 10.00),
    _flavor("a100x8", 8, "A100", 640, 20.00),
    _flavor("h200", 1, "H200", 141, 5.00),
    _flavor("h200x2", 2, "H200", 282, 10.00),
    _flavor("h200x4", 4, "H200", 564, 20.00),
    _flavor("h200x8", 8, "H200", 1128, 40.00),
    _flavor("rtx-pro-6000", 1, "RTX PRO 6000", 96, 2.75),
    _flavor("rtx-pro-6000x2", 2, "RTX PRO 6000", 192, 5.50),
    _flavor("rtx-pro-6000x4", 4, "RTX PRO 6000", 384, 11.00),
    _flavor("rtx-pro-6000x8", 8, "RTX PRO 6000", 768, 22.00),
)}
"""The GPU flavors as copied on PRICES_COPIED (CPU flavors left out: the planner places GPUs)."""

UNIT_HOURS = {"minute": 1 / 60, "hour": 1.0, "second": 1 / 3600}


def _gib(text: str) -> float:
    """'141 GB' -> its GiB."""
    number = float(re.match(r"\s*([\d.]+)", text).group(1))
    return number * (2**30 if "gib" in text.lower() else 1e9) / 2**30


def _gpu_model(model: str) -> str | None:
    """The GPU_SPECS key of a `JobAccelerator.model` ('H200', 'A100', 'RTX PRO 6000', ...)."""
    squashed = model.upper().replace("NVIDIA", "").replace("-", " ").split()
    for key in GPU_SPECS:
        if key.split() == squashed[:len(key.split())]:
            return key
    return None


def from_hub(hardware: list) -> dict[str, Flavor]:
    """Flavors from `HfApi.list_jobs_hardware()`'s `JobHardwareInfo` list: the GPU flavors
    whose GPU model GPU_SPECS knows (the others have no speed to plan with)."""
    found = {}
    for info in hardware:
        accelerator = info.accelerator
        if accelerator is None or info.unit_label not in UNIT_HOURS:
            continue
        model = _gpu_model(accelerator.model)
        if model is None:
            continue
        gpus = int(accelerator.quantity)
        hourly = info.unit_cost_usd / UNIT_HOURS[info.unit_label]
        # `vram` is the flavor's total ("Total VRAM"); FLAVORS keeps it per GPU
        found[info.name] = Flavor(info.name, gpus, model, round(_gib(accelerator.vram) / gpus, 1),
                                  round(hourly, 4), source="hub")
    return found


def flavors(refresh: bool = False, api=None) -> dict[str, Flavor]:
    """The GPU flavors by name: FLAVORS, or with `refresh` the Hub's list (`api`: an HfApi,
    default a new one) over it; offline or on any error of the Hub's, FLAVORS as committed."""
    if not refresh:
        return dict(FLAVORS)
    try:
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi()
        live = from_hub(api.list_jobs_hardware())
    except Exception:  # noqa: BLE001 (offline, no token, an API change: the committed table)
        return dict(FLAVORS)
    return {**FLAVORS, **live} if live else dict(FLAVORS)


def flavor(name: str, table: dict[str, Flavor] | None = None) -> Flavor:
    """One flavor by name, with a clear error naming the known ones."""
    table = FLAVORS if table is None else table
    if name not in table:
        raise ValueError(f"unknown GPU flavor {name!r}: choose one of {sorted(table)}")
    return table[name]


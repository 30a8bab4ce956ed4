"""How an HF job installs grpo_lab: the wheel carried in the bucket, lean and retried.

The plan (grpo_lab.launch.recipe_plan) copies a wheel of this checkout into the bucket before the
first job; each job that runs grpo_lab installs it from its mount with `wheel_install`'s shell
lines.
"""

from __future__ import annotations

import shlex

PIP_ATTEMPTS = 5
"""Times a job tries `pip install` (each with pip's own `--retries 5` per download): an index
that rate-limits the jobs' addresses must not lose the job, as in the reference's scripts."""

IMAGE_PINS = "/tmp/grpo-lab-image-pins.txt"
"""Where a job writes its image's own package versions (`pip list --format=freeze`) before
installing grpo_lab under them as constraints: pip then never moves a package the image's vLLM
was built against (it fails, naming the conflict, instead)."""

CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
"""Where a CPU image (no torch of its own) gets torch's CPU build, not the much larger CUDA one."""


def wheel_install(wheel: str, *, image_has_torch: bool, extra: tuple[str, ...] = (),
                  extras: tuple[str, ...] = ()) -> str:
    """Shell lines that install the grpo_lab wheel at `wheel` (a path on the bucket mount).

    Core dependencies only (`pip install <wheel>`, no extras: no notebook stack, no torch pin),
    so an image with torch (vLLM's) keeps its own; one without gets torch's CPU build. The
    mount may show the uploaded file some seconds late: wait for it (10 min at most). Then up
    to PIP_ATTEMPTS tries, 30 s apart, every package the image already has held at its version
    (IMAGE_PINS as `--constraint`). `extra`: more packages installed along with it; `extras`:
    the wheel's own optional extras (`tracking`: trackio and tensorboard)."""
    spec = shlex.quote(f"{wheel}[{','.join(extras)}]") if extras else wheel
    wheel_and_extra = " ".join([spec, *extra])
    index = "" if image_has_torch else f" --extra-index-url {CPU_TORCH_INDEX}"
    return "\n".join([
        f"for _ in $(seq 120); do test -f {wheel} && break; sleep 5; done",
        f"pip list --format=freeze > {IMAGE_PINS}",
        f"for attempt in $(seq {PIP_ATTEMPTS}); do",
        f"  pip install --quiet --retries 5 --constraint {IMAGE_PINS}{index} {wheel_and_extra}"
        " && break",
        f'  [ "$attempt" = {PIP_ATTEMPTS} ] && exit 1',
        f'  echo "pip install failed (attempt $attempt of {PIP_ATTEMPTS}); retrying in 30 s"; '
        'sleep 30',
        "done",
    ])

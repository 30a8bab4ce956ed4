"""Where `grpo-lab serve` runs: ServeConfig's `device` and `dtype` (auto = bfloat16 on a CUDA GPU,
float32 on the CPU), the server and its engine following them, and bfloat16 serving whose
logprobs still match the trainer's (both computed in float32). GPUs are simulated where only
the resolution is tested; the engine runs on the CPU here."""

from __future__ import annotations

import pytest
import torch

from grpo_lab.algo.logprobs import policy_logprobs
from grpo_lab.serve.batch import Sequence, make_generator
from grpo_lab.serve.config import ServeConfig
from grpo_lab.serve.engine import generate_sync
from grpo_lab.serve.sampling import SamplingParams
from grpo_lab.train.rollout_batch import pad_left, pad_right


@pytest.fixture
def gpu(monkeypatch):
    """Pretend torch sees a CUDA GPU (resolution only: nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_is_cuda_in_bfloat16_when_torch_sees_a_gpu(gpu):
    config = ServeConfig()
    assert (config.torch_device(), config.torch_dtype()) == ("cuda", torch.bfloat16)
    assert ServeConfig(dtype="float32").torch_dtype() == torch.float32
    assert ServeConfig(device="cpu").torch_dtype() == torch.float32  # auto follows the device


def test_auto_is_the_cpu_in_float32_without_a_gpu(no_gpu):
    config = ServeConfig()
    assert (config.torch_device(), config.torch_dtype()) == ("cpu", torch.float32)
    assert ServeConfig(dtype="bfloat16").torch_dtype() == torch.bfloat16


@pytest.mark.parametrize("fields, message", [
    ({"device": "cuda"}, "torch sees no CUDA GPU"),
    ({"device": "toaster"}, "not a torch device"),
    ({"dtype": "float64"}, "dtype must be auto or one of"),
])
def test_a_bad_device_or_dtype_fails_when_the_config_is_built(no_gpu, fields, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig(**fields)


def test_threads_are_one_on_the_cpu_and_left_to_torch_on_a_gpu(gpu):
    """Only the CPU (a run's processes share its few cores) or an explicit number sets them."""
    from grpo_lab.util.devices import default_threads

    assert ServeConfig().threads() is None  # auto = cuda here: torch keeps its own
    assert ServeConfig(device="cpu").threads() == 1
    assert ServeConfig(num_threads=4).threads() == 4  # asked for: on any device
    assert [default_threads(d) for d in ("cuda", "cuda:1", "cpu", "auto")] == [None, None, 1, None]
    assert default_threads("cuda", 2) == 2


def test_a_memory_share_caps_only_a_cuda_device(monkeypatch):
    from grpo_lab.util.devices import cap_gpu_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: calls.append((fraction, device)))
    cap_gpu_memory("cuda", 0.21)
    cap_gpu_memory("cuda:1", 1)
    cap_gpu_memory("cpu", 0.5)
    cap_gpu_memory("cuda", None)
    assert calls == [(0.21, None), (1.0, 1)]  # None: the current device
    assert all(isinstance(fraction, float) for fraction, _ in calls)  # torch takes floats only


def test_threads_stay_one_without_a_gpu(no_gpu):
    from grpo_lab.util.devices import default_threads

    assert ServeConfig().threads() == 1 and default_threads("auto") == 1
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        ServeConfig(num_threads=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        ServeConfig(gpu_memory_utilization=1.5)


def test_serve_takes_device_and_dtype_flags():
    from grpo_lab.cli.flags import config_from_args
    from grpo_lab.cli.main import build_parser

    args = build_parser().parse_args(["serve", "tiny", "--device", "cpu", "--dtype", "bfloat16"])
    config = config_from_args(args, ServeConfig)
    assert (config.device, config.dtype) == ("cpu", "bfloat16")


def test_server_in_bfloat16_reports_its_device_and_matches_the_trainer(tiny_model_dir):
    from grpo_lab.serve.server import InferenceServer

    torch.set_num_threads(1)
    server = InferenceServer(ServeConfig(device="cpu", dtype="bfloat16",
                                       logprobs_mode="processed_logprobs"))
    info = server.vllm_config()
    assert info["device_config"] == {"device": "cpu"}
    assert info["model_config"]["dtype"] == "torch.bfloat16"
    assert info["grpo_lab"]["peak_gpu_memory_bytes"] is None  # only a GPU has one
    engine, tokenizer = server.engine.start(), server.tokenizer
    try:
        prompts = [tokenizer(p)["input_ids"] for p in ("12+34=", "7+5=", "99+1=")]
        seqs = generate_sync(engine, [
            Sequence(p, SamplingParams(max_tokens=6, seed=i), None,
                     make_generator(i, engine.device)) for i, p in enumerate(prompts)])
    finally:
        engine.stop()
    p_ids, p_mask = pad_left([s.prompt_ids for s in seqs], tokenizer.pad_token_id)
    c_ids, c_mask = pad_right([s.output_ids for s in seqs], tokenizer.pad_token_id)
    served, _ = pad_right([s.logprobs for s in seqs], 0.0)
    with torch.no_grad():
        trained = policy_logprobs(engine.model, p_ids, p_mask, c_ids, c_mask)
    assert trained.dtype == torch.float32  # from bfloat16 weights
    assert ((trained - served).abs() * c_mask).max() < 1e-2


def test_the_engine_refuses_a_generator_on_another_device(tiny_model_dir):
    from grpo_lab.serve.server import InferenceServer

    engine = InferenceServer(ServeConfig(device="cpu")).engine
    engine.device = torch.device("cuda")  # as if it served on a GPU: a CPU generator cannot
    seq = Sequence([1, 5], SamplingParams(), None, make_generator(0))
    with pytest.raises(ValueError, match="make_generator"):
        generate_sync(engine, [seq], timeout=5)

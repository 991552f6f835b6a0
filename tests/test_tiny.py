"""The embedded tiny model: tokenizer, deterministic build, warm start, and that transformers
and vLLM load the saved directory and agree on greedy output."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import vllm_greedy

from pipelines.config import ArithmeticTaskConfig, TinyModelConfig
from pipelines.data.tasks import Reverse, task_from_config
from pipelines.models.tiny import CHARACTERS, WarmStartError, build_model, build_tokenizer, make_tiny

ROOT = Path(__file__).resolve().parent.parent


def test_tokenizer_is_character_level_and_round_trips():
    tok = build_tokenizer()
    text = "".join(CHARACTERS)
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.apply_chat_template([{"role": "user", "content": "12+7="}], tokenize=False, add_generation_prompt=True) == (
        "<bos>12+7="
    )


def test_build_is_deterministic_in_the_seed():
    tok = build_tokenizer()
    a = build_model(TinyModelConfig(seed=1), tok).state_dict()
    b = build_model(TinyModelConfig(seed=1), tok).state_dict()
    c = build_model(TinyModelConfig(seed=2), tok).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_warm_start_lands_in_its_band_and_records_how(tiny_model):
    path, manifest = tiny_model
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    assert not list(path.glob("*.bin")) and not list(path.glob("*.pt")), "weights must be safetensors only"
    assert manifest["heldout_problems"] == 500
    assert manifest["heldout_accuracy_before_sft"] < 0.05
    band = TinyModelConfig().band
    assert band.min_greedy <= manifest["check_greedy_accuracy"] <= band.max_greedy, manifest
    assert manifest["check_sampled_accuracy"] >= band.min_sampled, manifest
    last = manifest["warm_start_history"][-1]
    assert last["in_band"] and not any(h["in_band"] for h in manifest["warm_start_history"][:-1])
    assert (last["greedy"], last["sampled"]) == (manifest["check_greedy_accuracy"], manifest["check_sampled_accuracy"])
    # the reported accuracy is on other held-out problems; it lies near the checked one
    assert abs(manifest["heldout_accuracy"] - manifest["check_greedy_accuracy"]) < 0.1, manifest


def test_a_warm_start_outside_its_band_goes_on_then_fails_and_caches_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYPO_CACHE", str(tmp_path))
    # 20 SFT steps cannot teach addition: greedy stays near 0%, under the band's 20%
    cfg = TinyModelConfig(
        sft_steps=20, sft_problems=200, band={"problems": 50, "extra_rounds": 1, "extra_round_steps": 10, "attempts": 2}
    )
    lines: list[str] = []
    with pytest.raises(
        WarmStartError, match=r"did not land in its band \(greedy 20%-60%, sampled >= 50%\) after 2 initialisation"
    ):
        make_tiny(cfg, log=lines.append)
    rounds = [line for line in lines if line.startswith("warm-start SFT")]
    assert rounds == [
        "warm-start SFT (attempt 1, round 1): 20 steps on 200 train problems",
        "warm-start SFT (attempt 1, round 2): 10 steps on 200 train problems",
        "warm-start SFT (attempt 2, round 1): 20 steps on 200 train problems",
        "warm-start SFT (attempt 2, round 2): 10 steps on 200 train problems",
    ]
    cached = [p for p in tmp_path.iterdir() if p.suffix != ".lock"]  # the build's lock file stays, empty
    assert not cached, "a model outside its band must not be cached"


def test_second_call_reuses_the_cache(tiny_model):
    lines: list[str] = []
    path, manifest = make_tiny(TinyModelConfig(), log=lines.append)
    assert path == tiny_model[0] and manifest == tiny_model[1]
    assert lines == [f"tiny model cached at {path} (held-out greedy accuracy {manifest['heldout_accuracy']:.1%})"]


def test_saved_model_reproduces_the_reported_accuracy(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelines.data.evaluate import greedy_accuracy

    path, manifest = tiny_model
    cfg = TinyModelConfig()
    heldout = task_from_config(cfg.sft_tasks[0]).sample(cfg.heldout_problems, "heldout", cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert greedy_accuracy(model, tokenizer, heldout) == pytest.approx(manifest["heldout_accuracy"])


@pytest.mark.slow
def test_transformers_and_vllm_agree_on_greedy_output(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelines.data.evaluate import greedy_complete

    path, _ = tiny_model
    arithmetic = task_from_config(ArithmeticTaskConfig()).sample(48, "heldout", seed=5)
    prompts = [p.prompt for p in arithmetic] + [p.prompt for p in Reverse().sample(16, "heldout", seed=5)]
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    expected = greedy_complete(model, tokenizer, prompts, max_new_tokens=8)

    got = vllm_greedy(path, prompts, 8)
    assert got == expected
    assert sum(g == p.answer for g, p in zip(got, arithmetic, strict=False)) > 0  # the model answers some correctly


def test_cli_make_tiny_prints_the_accuracy(tiny_model):
    out = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "make-tiny"], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert out.returncode == 0, out.stderr
    assert f"held-out greedy accuracy: {tiny_model[1]['heldout_accuracy']:.1%}" in out.stdout
    assert str(tiny_model[0]) in out.stdout


def test_two_processes_building_one_model_at_once_build_it_once(tmp_path):
    """Tune trials and parallel jobs may ask for the same tiny model together: one builds under the
    cache's lock, the other waits and reuses it (without the lock both built and one deleted the
    other's directory mid-rename)."""
    quick = [  # a small model that builds in seconds and a band it always lands in
        "--set", "model.tiny.sft_steps=30", "--set", "model.tiny.sft_problems=200", "--set", "model.tiny.heldout_problems=50",
        "--set", "model.tiny.band={problems: 50, samples: 1, min_greedy: 0, max_greedy: 1, min_sampled: 0}",
    ]  # fmt: skip
    env = {**os.environ, "RAYPO_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pipelines.cli", "make-tiny", *quick], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    built = [out for out in outputs if "built tiny Llama" in out]
    reused = [out for out in outputs if "tiny model cached at" in out]
    assert len(built) == 1 and len(reused) == 1, outputs
    models = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(models) == 1 and (models[0] / "model.safetensors").is_file()
    assert outputs[0].strip().splitlines()[-1] == outputs[1].strip().splitlines()[-1] == str(models[0])

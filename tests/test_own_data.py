"""Your own data, as the README shows it: `raypo train -c CONFIG` on a JSON Lines file of chat
prompts with a reward file that reads a dataset column, then `raypo eval`, both as subprocesses
on a local Ray sized from this machine (the embedded tiny model, so it runs in minutes)."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from conftest import RAYPO, ROOT

from pipelines.data.tasks import Arithmetic

pytestmark = pytest.mark.slow
GROUP = 4

REWARD = '''
import json

def correct(prompts, completions, target, row_id, **fields):
    """1.0 for the exact target; logs what it was given, one line per call."""
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"prompts": prompts, "completions": completions, "target": target, "row_id": row_id}}) + "\\n")
    return [float(c.strip() == t) for c, t in zip(completions, target)]
'''


def _rows(split: str, n: int, start: int) -> list[dict]:
    problems = Arithmetic(operators="+").sample(n, split, seed=7)
    return [
        {"messages": [{"role": "user", "content": p.prompt}], "target": p.answer, "row_id": start + i}
        for i, p in enumerate(problems)
    ]


@pytest.fixture(scope="module")
def own_run(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("own-data")
    rows = {"train": _rows("train", 64, 0), "heldout": _rows("heldout", 20, 1000)}
    for split, split_rows in rows.items():
        (tmp / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split_rows))
    (tmp / "reward.py").write_text(REWARD.format(log=str(tmp / "calls.jsonl")))
    config = {
        "name": "own",
        "output_dir": str(tmp / "runs"),
        "task": {
            "dataset": {
                "path": str(tmp / "train.jsonl"),
                "heldout_path": str(tmp / "heldout.jsonl"),
                "prompt_key": "messages",
                "answer_key": "target",
            },
            "eval_problems": 20,
        },
        "reward": {"terms": [{"fn": f"{tmp / 'reward.py'}:correct"}]},
        "algo": {"name": "grpo", "group_size": GROUP},
        "training": {"batch_size": 16, "minibatch_size": 16, "steps": 2, "save_every": 0, "lr": 1e-4},
        "inference": {"max_tokens": 8, "temperature": 1.0, "top_p": 1.0},
        "eval": {"samples": 2, "every": 1},
    }
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    run = subprocess.run([*RAYPO, "train", "-c", str(tmp / "config.yaml")], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return tmp, rows, json.loads(run.stdout[run.stdout.index("{") :])


def test_the_reward_gets_each_samples_own_dataset_columns(own_run, tiny_model):
    from transformers import AutoTokenizer

    tmp, rows, summary = own_run
    tokenizer = AutoTokenizer.from_pretrained(tiny_model[0])
    by_id = {r["row_id"]: r for split in rows.values() for r in split}
    calls = [json.loads(line) for line in (tmp / "calls.jsonl").read_text().splitlines()]
    train_calls = [c for c in calls if len(c["row_id"]) == 16]  # the two steps' batches: 4 prompts x 4 samples
    assert len(train_calls) == 2, [len(c["row_id"]) for c in calls]
    for call in calls:
        assert len(call["prompts"]) == len(call["completions"]) == len(call["target"]) == len(call["row_id"])
        for prompt, target, row_id in zip(call["prompts"], call["target"], call["row_id"], strict=True):
            row = by_id[row_id]
            assert target == row["target"]
            rendered = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
            assert prompt == rendered.removeprefix(tokenizer.bos_token)  # the chat template, one BOS (the tokenizer's)
    for call in train_calls:  # each prompt's group of samples shares its row
        ids = call["row_id"]
        assert all(len(set(ids[i : i + GROUP])) == 1 for i in range(0, len(ids), GROUP))
        assert all(r < 1000 for r in ids)  # train rows only; held-out ids start at 1000
    assert summary["steps"] == 2 and summary["eval_problems"] == 20


def test_training_evaluates_on_the_heldout_file_before_and_after(own_run):
    tmp, rows, summary = own_run
    for label in ("eval_start", "eval_end"):
        ev = summary[label]
        assert ev["problems"] == 20 and ev["k"] == 2
        assert set(ev) >= {"reward_mean", f"reward_mean/{tmp / 'reward.py'}:correct", "pass_rate", "pass_at_k"}
        assert ev["pass_rate"] == pytest.approx(ev["reward_mean"])  # one 0/1 term, threshold 1.0
    metrics = [json.loads(x) for x in (tmp / "runs" / "own" / "metrics.jsonl").read_text().splitlines()]
    # eval.every=1: of the weights after step 0 (the last step's is eval_end), run beside step 1 and reported with it
    assert metrics[1]["eval/problems"] == 20 and "eval/pass_at_k" in metrics[1] and metrics[1]["eval/step"] == 1
    assert "eval/problems" not in metrics[0]
    assert (tmp / "runs" / "own" / "eval_step_1.jsonl").is_file()
    per_sample = [json.loads(x) for x in (tmp / "runs" / "own" / "eval_end.jsonl").read_text().splitlines()]
    assert len(per_sample) == 20 and sum(r["passed"] for r in per_sample) / 20 == summary["eval_end"]["pass_rate"]


def _raypo_eval(tmp, out, *overrides: str) -> dict:
    final = tmp / "runs" / "own" / "final"
    command = [*RAYPO, "eval", "--model", str(final), "-c", str(tmp / "config.yaml"), "--out", str(out)]
    run = subprocess.run([*command, *overrides], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout[run.stdout.rindex("\n{") :])  # printed last, after vLLM's own lines


def test_raypo_eval_reports_reward_pass_rate_and_pass_at_k_per_sample(own_run):
    """Also: the engine evaluates in the run's engine dtype, `inference.dtype` where it is set."""
    tmp, rows, summary = own_run
    out = tmp / "eval.jsonl"
    report = _raypo_eval(tmp, out)
    assert report["problems"] == 20 and report["k"] == 2 and report["per_sample"] == str(out)
    assert report["dtype"] == "float32"
    # the same greedy completions as the trainer's own end-of-run evaluation (same weights, same engine)
    assert report["pass_rate"] == summary["eval_end"]["pass_rate"]
    rows_out = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["answer"] for r in rows_out] == [r["target"] for r in rows["heldout"]]
    assert all(0 <= r["samples_passed"] <= 2 for r in rows_out)
    assert _raypo_eval(tmp, tmp / "eval_bf16.jsonl", "--set", "inference.dtype=bfloat16")["dtype"] == "bfloat16"


def test_a_malformed_row_stops_raypo_train_before_ray_starts(own_run):
    tmp, rows, _ = own_run
    calls_before = (tmp / "calls.jsonl").read_text()
    bad = tmp / "bad.jsonl"
    lines = (tmp / "train.jsonl").read_text().splitlines()
    bad.write_text("\n".join([*lines[:9], '{"messages": "12+7=", "target": 19', *lines[9:]]) + "\n")
    run = subprocess.run(
        [*RAYPO, "train", "-c", str(tmp / "config.yaml"), "--set", f"task.dataset.path={bad}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"{bad}:10: not valid JSON" in run.stderr and "1 of 65 rows are malformed" in run.stderr
    assert "Started a local Ray" not in run.stderr + run.stdout
    assert (tmp / "calls.jsonl").read_text() == calls_before  # no reward actor ever ran

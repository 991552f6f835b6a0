"""Preference pairs for DPO (pipelines/data/preferences.py and dataset.preference_problem): the
built-in set from the tasks, TRL's preference formats read from files, each malformed kind named
with its file and line, and the token arrays the reference model and the learners read. With the
embedded tiny model's real tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import write_jsonl

from pipelines.config import DatasetConfig
from pipelines.data.dataset import DatasetError, load_dataset_task
from pipelines.data.preferences import PreferencePair, encode_pairs, pair_of
from pipelines.data.tasks import Arithmetic, add_without_carry


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


def _load(tokenizer, rows, tmp_path, **options):
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    return load_dataset_task(DatasetConfig(path=str(path), heldout_percent=25, **options), tokenizer, preferences=True)


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


def test_the_built_in_set_prefers_the_answer_over_the_warm_starts_slip():
    problems = Arithmetic(operators="+").sample(300, "train", 0)
    pairs = {p.prompt: pair_of(p) for p in problems}
    assert all(pairs[p.prompt].chosen == p.answer != pairs[p.prompt].rejected for p in problems)
    carries = [p for p in problems if add_without_carry(*map(int, p.prompt[:-1].split("+"))) != int(p.answer)]
    assert len(carries) > 100  # about half of two-digit sums carry
    # where the warm start's slip is wrong, it is what DPO learns to reject; elsewhere a near miss
    assert all(pairs[p.prompt].rejected == p.slip for p in carries)
    assert all(pairs[p.prompt].rejected == str(int(p.answer) + 1) for p in problems if p not in carries)


PAIRS = [(f"{a}+{a}=", str(2 * a), str(2 * a + 1)) for a in range(40)]
FORMATS = {
    "strings": [{"prompt": p, "chosen": c, "rejected": r, "level": 1} for p, c, r in PAIRS],
    "chat, explicit prompt": [
        {"prompt": [_user(p)], "chosen": [_assistant(c)], "rejected": [_assistant(r)], "level": 1} for p, c, r in PAIRS
    ],
    "chat, implicit prompt": [
        {"chosen": [_user(p), _assistant(c)], "rejected": [_user(p), _assistant(r)], "level": 1} for p, c, r in PAIRS
    ],
}


@pytest.mark.parametrize("rows", FORMATS.values(), ids=FORMATS.keys())
def test_trls_preference_formats_give_the_same_pairs(tmp_path, tokenizer, rows):
    task = _load(tokenizer, rows, tmp_path)
    problems = task.problems["train"] + task.problems["heldout"]
    assert sorted((pair_of(p).prompt, pair_of(p).chosen, pair_of(p).rejected) for p in problems) == sorted(PAIRS)
    assert all(p.fields["level"] == 1 for p in problems)  # other columns still reach the rewards


def test_chat_completions_are_the_templates_text_after_the_prompt(tmp_path, tokenizer):
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}|{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    task = _load(tokenizer, FORMATS["chat, implicit prompt"], tmp_path, chat_template=template)
    pair = pair_of(task.problems["train"][0])
    assert pair.prompt.startswith("<user>") and pair.prompt.endswith("=|<assistant>")
    assert pair.chosen.endswith("|") and pair.chosen[:-1].isdigit()  # the turn's end is part of the completion


BAD_PAIRS = [
    ("{not json", "not valid JSON"),
    ('{"prompt": "2+2=", "rejected": "5"}', "no chosen column 'chosen'"),
    ('{"prompt": "2+2=", "chosen": "4", "rejected": "  "}', "column 'rejected' must be a non-empty string or chat messages"),
    ('{"prompt": "2+2=", "chosen": 4, "rejected": "5"}', "column 'chosen' must be a non-empty string or chat messages"),
    ('{"chosen": "4", "rejected": "5"}', "no prompt column 'prompt'"),
    (
        json.dumps({"chosen": [_user("1+1="), _assistant("2")], "rejected": [_user("1+2="), _assistant("3")]}),
        "no prompt column 'prompt', and chosen and rejected differ before their last message",
    ),
]


@pytest.mark.parametrize("bad, message", BAD_PAIRS, ids=[m.split()[0] + "-" + str(i) for i, (_, m) in enumerate(BAD_PAIRS)])
def test_a_malformed_pair_is_named_with_its_file_and_line(tmp_path, tokenizer, bad, message):
    rows = FORMATS["strings"]
    with pytest.raises(DatasetError) as err:
        _load(tokenizer, [*rows[:5], bad, *rows[5:]], tmp_path)
    assert f"pairs.jsonl:6: {message}" in str(err.value), str(err.value)
    assert "1 of 41 rows are malformed" in str(err.value)
    # within max_bad_fraction the row is skipped and counted, and the rest loads
    task = _load(tokenizer, [*rows[:5], bad, *rows[5:]], tmp_path, max_bad_fraction=0.05)
    assert task.report["malformed_skipped"] == 1 and len(task.problems["train"]) + len(task.problems["heldout"]) == 40


def test_encoded_pairs_are_left_padded_prompts_and_right_padded_completions_ending_in_eos(tokenizer):
    pairs = [PreferencePair("1+1=", "2", "11"), PreferencePair("10+10=", "20", "3")]
    arrays = encode_pairs(tokenizer, pairs)
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    assert arrays["prompt_ids"].shape == (2, 7) and arrays["prompt_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert arrays["prompt_ids"][0, 2] == bos and tokenizer.decode(arrays["prompt_ids"][1, 1:]) == "10+10="
    assert arrays["chosen_mask"].sum(axis=1).tolist() == [2, 3] and arrays["rejected_mask"].sum(axis=1).tolist() == [3, 2]
    assert arrays["chosen_ids"][0, :2].tolist() == [*tokenizer("2", add_special_tokens=False)["input_ids"], eos]
    assert np.all(arrays["rejected_ids"][1, 2:] == (tokenizer.pad_token_id or 0))

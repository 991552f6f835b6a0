"""The user's own dataset as a task (pipelines/data/dataset.py): every source kind, the held-out
split three ways, chat templates, and each kind of malformed row named with its file and line.
Prompts are rendered and counted with the embedded tiny model's real tokenizer."""

from __future__ import annotations

import datasets
import pytest
from conftest import write_jsonl

from pipelines.config import DatasetConfig, load_config
from pipelines.data.dataset import DatasetError, load_dataset_task
from pipelines.data.tasks import reward_fields

ROWS = [{"prompt": f"{a}+{a}=", "answer": str(2 * a), "level": a % 3} for a in range(40)]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


def _load(tokenizer, **options):
    return load_dataset_task(DatasetConfig(**options), tokenizer)


def test_jsonl_rows_become_problems_whose_other_columns_reach_the_rewards(tmp_path, tokenizer):
    task = _load(tokenizer, path=str(write_jsonl(tmp_path / "d.jsonl", ROWS)), heldout_percent=25)
    train, heldout = task.problems["train"], task.problems["heldout"]
    assert len(train) + len(heldout) == 40 and task.report["heldout_from"] == "25% of the prompts by hash"
    assert 4 <= len(heldout) <= 16  # a hashed quarter of 40
    assert {p.prompt for p in train}.isdisjoint(p.prompt for p in heldout)
    fields = reward_fields(train[:3])
    assert set(fields) == {"answer", "level"}
    by_prompt = {r["prompt"]: r for r in ROWS}
    assert fields["level"] == [by_prompt[p.prompt]["level"] for p in train[:3]]
    assert fields["answer"] == [by_prompt[p.prompt]["answer"] for p in train[:3]]
    # the same split however often it is loaded (a hash of the prompt, not a random draw)
    again = _load(tokenizer, path=str(tmp_path / "d.jsonl"), heldout_percent=25)
    assert [p.prompt for p in again.problems["heldout"]] == [p.prompt for p in heldout]


def test_the_train_stream_is_seeded_and_visits_every_prompt_each_epoch(tmp_path, tokenizer):
    task = _load(tokenizer, path=str(write_jsonl(tmp_path / "d.jsonl", ROWS)), heldout_percent=25)
    n = len(task.problems["train"])
    stream = task.stream("train", seed=3)
    epoch = [next(stream).prompt for _ in range(n)]
    assert sorted(epoch) == sorted(p.prompt for p in task.problems["train"])
    assert [next(task.stream("train", seed=3)).prompt] == epoch[:1]
    assert epoch != [next(s).prompt for s in [task.stream("train", seed=4)] for _ in range(n)]


def test_chat_messages_go_through_the_chat_template_once_with_one_bos(tmp_path, tokenizer):
    rows = [{"messages": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in ROWS]
    task = _load(tokenizer, path=str(write_jsonl(tmp_path / "chat.jsonl", rows)), prompt_key="messages")
    problem = task.problems["train"][0]
    assert problem.prompt.endswith("=") and "<bos>" not in problem.prompt  # the tokenizer adds the BOS itself
    ids = tokenizer(problem.prompt)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1
    templated = _load(
        tokenizer,
        path=str(tmp_path / "chat.jsonl"),
        prompt_key="messages",
        chat_template="{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}",
    )
    assert templated.problems["train"][0].prompt.startswith("[user] ")
    plain = _load(
        tokenizer,
        path=str(write_jsonl(tmp_path / "plain.jsonl", ROWS)),
        apply_chat_template=True,
        chat_template="Q: {{ messages[0].content }}",
    )
    assert plain.problems["train"][0].prompt.startswith("Q: ")


def test_held_out_from_a_second_file_a_directorys_split_and_a_saved_dataset(tmp_path, tokenizer):
    write_jsonl(tmp_path / "train.jsonl", ROWS[:30])
    write_jsonl(tmp_path / "other.jsonl", ROWS[30:])
    task = _load(tokenizer, path=str(tmp_path / "train.jsonl"), heldout_path=str(tmp_path / "other.jsonl"))
    assert len(task.problems["train"]) == 30 and len(task.problems["heldout"]) == 10

    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", ROWS[:25])
    write_jsonl(folder / "test.jsonl", ROWS[25:])
    task = _load(tokenizer, path=str(folder))
    assert (len(task.problems["train"]), len(task.problems["heldout"]), task.report["heldout_from"]) == (25, 15, "split 'test'")

    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:20]), "validation": datasets.Dataset.from_list(ROWS[20:])}
    ).save_to_disk(str(saved))
    task = _load(tokenizer, path=str(saved), heldout_split="validation")
    assert (len(task.problems["train"]), len(task.problems["heldout"])) == (20, 20)
    assert task.problems["train"][0].fields["level"] == ROWS[0]["level"]


def test_csv_parquet_and_globs_load_alike(tmp_path, tokenizer):
    datasets.Dataset.from_list(ROWS[:20]).to_csv(str(tmp_path / "a.csv"), index=False)
    datasets.Dataset.from_list(ROWS[20:]).to_parquet(str(tmp_path / "b.parquet"))
    task = _load(tokenizer, path=[str(tmp_path / "a.csv"), str(tmp_path / "*.parquet")], heldout_percent=20)
    prompts = {p.prompt for split in task.problems.values() for p in split}
    assert prompts == {r["prompt"] for r in ROWS}


BAD_ROWS = [
    ("{not json", "not valid JSON"),
    ('{"answer": "4"}', "no prompt column 'prompt'"),
    ('{"prompt": 12, "answer": "4"}', "must be a non-empty string or chat messages"),
    ('{"prompt": "2+2="}', "no answer column 'answer'"),
    ('{"prompt": "2+2=", "answer": {"x": 4}}', "column 'answer' must be a string or a number, got dict"),
    ('{"prompt": "2+2=", "answer": "4", "completions": "x"}', "column 'completions' clashes"),
    ('["2+2=", "4"]', "a row must be an object of columns, got list"),
]


@pytest.mark.parametrize("bad, message", BAD_ROWS, ids=[m.split()[0] + "-" + str(i) for i, (_, m) in enumerate(BAD_ROWS)])
def test_a_malformed_row_is_named_with_its_file_and_line_before_anything_starts(tmp_path, tokenizer, bad, message):
    path = write_jsonl(tmp_path / "d.jsonl", [*ROWS[:5], bad, *ROWS[5:]])
    with pytest.raises(DatasetError) as err:
        _load(tokenizer, path=str(path))
    assert f"{path}:6: " in str(err.value) and message in str(err.value), str(err.value)
    assert "1 of 41 rows are malformed" in str(err.value)


def test_a_bad_csv_row_names_its_line_counting_the_header(tmp_path, tokenizer):
    path = tmp_path / "d.csv"
    path.write_text("prompt,answer\n1+1=,2\n,3\n2+2=,4\n")  # line 3: empty prompt
    with pytest.raises(DatasetError, match=rf"{path}:3: column 'prompt' must be a non-empty string"):
        _load(tokenizer, path=str(path))


def test_bad_rows_within_max_bad_fraction_are_skipped_and_counted(tmp_path, tokenizer, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", [*ROWS, "{broken", '{"prompt": "x"}'])
    task = _load(tokenizer, path=str(path), max_bad_fraction=0.1)
    assert task.report["malformed_skipped"] == 2
    assert len(task.problems["train"]) + len(task.problems["heldout"]) == 40
    assert "2 of 42 rows are malformed; skipped them" in capsys.readouterr().err
    with pytest.raises(DatasetError, match="2 of 42 rows are malformed"):
        _load(tokenizer, path=str(path), max_bad_fraction=0.04)


def test_prompts_over_max_prompt_tokens_are_dropped_and_counted(tmp_path, tokenizer):
    rows = [*ROWS, {"prompt": "1+" * 60 + "1=", "answer": "61"}]
    task = _load(tokenizer, path=str(write_jsonl(tmp_path / "d.jsonl", rows)), max_prompt_tokens=16)
    assert task.report["too_long_dropped"] == 1
    assert all(len(tokenizer(p.prompt)["input_ids"]) <= 16 for split in task.problems.values() for p in split)


def test_missing_sources_and_splits_are_named(tmp_path, tokenizer):
    with pytest.raises(DatasetError, match="dataset path .*nowhere.jsonl' does not exist"):
        _load(tokenizer, path=str(tmp_path / "nowhere.jsonl"))
    with pytest.raises(DatasetError, match="glob .* matches no file"):
        _load(tokenizer, path=str(tmp_path / "*.jsonl"))
    write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DatasetError, match="heldout_split 'dev': the dataset's splits are \\['train'\\]"):
        _load(tokenizer, path=str(tmp_path / "d.jsonl"), heldout_split="dev")


def test_config_takes_a_dataset_or_a_built_in_task_not_both(tmp_path):
    cfg = load_config(None, ["task.dataset.path=data.jsonl"])
    assert cfg.task.dataset.path == "data.jsonl" and cfg.task.dataset.prompt_key == "prompt"
    with pytest.raises(ValueError, match="task.task and task.dataset are both set"):
        load_config(None, ["task.dataset.path=data.jsonl", "task.task.name=reverse"])


@pytest.mark.parametrize("written", ['""', "", "null"])
def test_an_empty_answer_key_means_no_answer_column(tmp_path, tokenizer, written):
    """README: `answer_key:` empty = no answer column, whether written `""`, blank or null; the
    rows load (none is called malformed) and no reward sees an `answer`."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": r["prompt"], "level": r["level"]} for r in ROWS])
    preset = tmp_path / "p.yaml"
    preset.write_text(f"task:\n  dataset:\n    path: {data}\n    answer_key: {written}\n")
    cfg = load_config(preset)
    assert cfg.task.dataset.answer_key is None
    task = load_dataset_task(cfg.task.dataset, tokenizer)
    problems = task.problems["train"] + task.problems["heldout"]
    assert len(problems) == 40 and "answer" not in reward_fields(problems)

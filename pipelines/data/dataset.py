"""Your own prompts as a task: rows of a dataset turned into `Problem`s, checked row by row.

Sources (`task.dataset.path`, and `heldout_path`): JSON Lines, JSON, CSV or Parquet files (a
path, a glob or a list of them), a directory of such files (its splits from the file names,
as Hugging Face `datasets` infers them: `train.jsonl`, `test.jsonl`, ...), or a directory
written by `Dataset.save_to_disk`. JSON Lines and JSON are read here, line by line, so that a
bad line is reported with its file and line (`datasets`' JSON loader fails the whole file
with "Expected object or value" and no line); CSV, Parquet and saved datasets are read by
`datasets`.

A row is malformed when its prompt column is missing or neither a string nor chat messages
(`[{"role": ..., "content": ...}, ...]`), or its answer column is missing or not a scalar. For
DPO a row is a preference pair instead (`preference_problem`: a prompt with `chosen` and
`rejected` completions, strings or chat messages, TRL's formats), malformed when one of them is
missing, empty or of another type. Bad rows are reported as `file:line: reason`; past
`max_bad_fraction` the load stops with all of them counted, before any actor starts. Prompts
longer than `max_prompt_tokens` (after the chat template) are dropped and counted.
"""

from __future__ import annotations

import functools
import glob
import json
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.data.tasks import Problem, Split, Task, in_heldout, task_from_config

if TYPE_CHECKING:  # for annotations only
    from pipelines.config import DatasetConfig, RaypoConfig

FILE_KINDS = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
RESERVED_COLUMNS = ("prompts", "completions")  # the reward functions' own positional arguments
HELDOUT_SPLITS = ("test", "validation", "heldout")  # a dataset's own held-out split, when none is named
SHOWN_ERRORS = 10


class DatasetError(ValueError):
    """The dataset cannot be used; the message names the file (and line) and the cause."""


@dataclass(frozen=True)
class Row:
    where: str  # "file:line" (JSON Lines, CSV), "file:row N" (Parquet, saved datasets)
    data: Any


# ----------------------------------------------------------------------------- reading rows
def _jsonl_rows(path: Path) -> Iterator[Row]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield Row(where, json.loads(line))
            except json.JSONDecodeError as err:
                yield Row(where, _Bad(f"not valid JSON ({err.msg} at column {err.colno})"))


def _json_rows(path: Path) -> Iterator[Row]:
    text = path.read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):  # a .json file of one object per line
        yield from _jsonl_rows(path)
        return
    try:
        items = json.loads(text)
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
    for index, item in enumerate(items):
        yield Row(f"{path}:item {index}", item)


def _table_rows(path: Path, kind: str) -> Iterator[Row]:
    import datasets  # heavy (pandas, fsspec): only for CSV and Parquet

    try:
        table = datasets.load_dataset(kind, data_files=[str(path)], split="train")
    except Exception as err:  # datasets wraps parser errors in its own types
        raise DatasetError(f"{path}: cannot be read as {kind}: {type(err).__name__}: {_first_line(err)}") from None
    first_line = 2 if kind == "csv" else 0  # a CSV's line 1 is its header
    for index, item in enumerate(table):
        yield Row(f"{path}:{index + first_line}" if kind == "csv" else f"{path}:row {index}", item)


def _saved(path: Path):
    import datasets  # heavy: only for a saved dataset

    try:
        return datasets.load_from_disk(str(path))
    except Exception as err:
        raise DatasetError(f"{path}: cannot be read as a saved dataset: {type(err).__name__}: {_first_line(err)}") from None


def _saved_splits(loaded) -> dict:
    return dict(loaded) if hasattr(loaded, "keys") else {"train": loaded}  # a DatasetDict, or one Dataset


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [""])[0][:300]


@dataclass(frozen=True)
class _Bad:
    reason: str


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def directory_splits(path: Path) -> dict[str, list[Path]]:
    """Split name -> files of a directory of data files, named as `datasets` names them
    (`train.jsonl`, `data/test-00000.parquet`, ...); every file is `train` when no name says."""
    from datasets.data_files import get_data_patterns  # only for a directory of files

    files = {}
    for split, patterns in get_data_patterns(str(path)).items():
        found = sorted({Path(f) for pattern in patterns for f in glob.glob(str(path / pattern), recursive=True)})
        files[str(split)] = [f for f in found if f.suffix in FILE_KINDS]
    return {split: fs for split, fs in files.items() if fs}


def _expand(spec: str | list[str]) -> list[Path]:
    paths: list[Path] = []
    for item in [spec] if isinstance(spec, str) else spec:
        expanded = Path(item).expanduser()
        if glob.has_magic(str(expanded)):
            matched = sorted(Path(p) for p in glob.glob(str(expanded), recursive=True))
            if not matched:
                raise DatasetError(f"dataset glob {item!r} matches no file")
            paths += matched
        elif not expanded.exists():
            raise DatasetError(f"dataset path {item!r} does not exist")
        else:
            paths.append(expanded)
    return paths


def read_rows(spec: str | list[str], split: str | None = None) -> tuple[list[Row], list[str]]:
    """The rows of `spec` (of `split` where the source has splits) and the split names it has."""
    rows: list[Row] = []
    splits: set[str] = set()
    for path in _expand(spec):
        if path.is_dir() and _is_saved_dataset(path):
            by_split = _saved_splits(_saved(path))
            splits.update(by_split)
            rows += [Row(f"{path}:row {i}", item) for i, item in enumerate(by_split.get(split or "train", []))]
        elif path.is_dir():
            by_split = directory_splits(path)
            if not by_split:
                raise DatasetError(f"dataset directory {str(path)!r} holds no {', '.join(FILE_KINDS)} files")
            splits.update(by_split)
            for file in by_split.get(split or "train", []):
                rows += _file_rows(file)
        else:
            splits.add("train")
            if split in (None, "train"):
                rows += _file_rows(path)
    return rows, sorted(splits)


def _file_rows(path: Path) -> list[Row]:
    kind = FILE_KINDS.get(path.suffix.lower())
    if kind is None:
        raise DatasetError(f"{path}: unknown data file type {path.suffix!r}; use one of {', '.join(FILE_KINDS)}")
    if kind == "jsonl":
        return list(_jsonl_rows(path))
    if kind == "json":
        return list(_json_rows(path))
    return list(_table_rows(path, kind))


# ----------------------------------------------------------------------------- rows -> problems
@dataclass
class Loaded:
    """What loading one split gave: its problems and what was left out, and why."""

    problems: list[Problem] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)  # "file:line: reason"
    too_long: int = 0
    rows: int = 0


def _is_chat(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    )


def row_problem(data: Any, cfg: DatasetConfig, render: Callable[[Any, bool], str]) -> Problem:
    """The `Problem` of one row, or ValueError naming what is wrong with it.

    >>> from pipelines.config import DatasetConfig
    >>> cfg = DatasetConfig(path="x.jsonl")
    >>> row_problem({"prompt": "2+2=", "answer": 4, "level": 1}, cfg, lambda p, chat: p)
    Problem(prompt='2+2=', answer='4', slip=None, fields={'answer': '4', 'level': 1})
    >>> row_problem({"question": "2+2="}, cfg, lambda p, chat: p)
    Traceback (most recent call last):
    ...
    ValueError: no prompt column 'prompt' (columns: question)
    """
    if not isinstance(data, dict):
        raise ValueError(f"a row must be an object of columns, got {type(data).__name__}")
    if cfg.prompt_key not in data:
        raise ValueError(f"no prompt column {cfg.prompt_key!r} (columns: {', '.join(map(str, data)) or 'none'})")
    prompt = data[cfg.prompt_key]
    chat = _is_chat(prompt)
    if not chat and not (isinstance(prompt, str) and prompt.strip()):
        raise ValueError(
            f"column {cfg.prompt_key!r} must be a non-empty string or chat messages [{{role, content}}, ...], "
            f"got {type(prompt).__name__}"
        )
    _check_no_clash(data, cfg)
    fields = {k: v for k, v in data.items() if k != cfg.prompt_key}
    answer = _answer(data, cfg, required=True)
    if answer is not None:
        fields["answer"] = answer
    return Problem(prompt=render(prompt, chat), answer=answer, fields=fields)


def _answer(data: dict, cfg: DatasetConfig, required: bool) -> str | None:
    """The row's answer as text; a missing column is an error when `required`, else None."""
    if cfg.answer_key is None or (cfg.answer_key not in data and not required):
        return None
    if cfg.answer_key not in data:
        raise ValueError(f"no answer column {cfg.answer_key!r} (columns: {', '.join(map(str, data))})")
    value = data[cfg.answer_key]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"column {cfg.answer_key!r} must be a string or a number, got {type(value).__name__}")
    return str(value)


def _check_no_clash(data: dict, cfg: DatasetConfig) -> None:
    clash = [k for k in RESERVED_COLUMNS if k in data] + (["answer"] if "answer" in data and cfg.answer_key != "answer" else [])
    if clash:
        raise ValueError(f"column {clash[0]!r} clashes with the reward functions' argument of that name; rename it")


def _columns(data: dict) -> str:
    return ", ".join(map(str, data)) or "none"


def preference_problem(data: Any, cfg: DatasetConfig, render: Renderer) -> Problem:
    """The `Problem` of one preference row (DPO), or ValueError naming what is wrong with it.

    TRL's preference formats: `{prompt, chosen, rejected}` with the completions as strings or as
    assistant messages, or only `chosen` and `rejected` as whole conversations that share every
    message but the last (the prompt is that shared part). The answer column is optional here.
    Its fields hold the rendered `chosen` and `rejected` texts.

    >>> from pipelines.config import DatasetConfig
    >>> cfg, plain = DatasetConfig(path="x.jsonl"), Renderer(lambda p, chat: p, lambda p, chat, c: c)
    >>> preference_problem({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, cfg, plain).fields
    {'chosen': '4', 'rejected': '5', 'answer': None}
    >>> preference_problem({"prompt": "2+2=", "chosen": "4", "rejected": " "}, cfg, plain)
    Traceback (most recent call last):
    ...
    ValueError: column 'rejected' must be a non-empty string or chat messages [{role, content}, ...], got an empty string
    """
    if not isinstance(data, dict):
        raise ValueError(f"a row must be an object of columns, got {type(data).__name__}")
    keys = {"chosen": cfg.chosen_key, "rejected": cfg.rejected_key}
    for side, key in keys.items():
        if key not in data:
            raise ValueError(f"no {side} column {key!r} (columns: {_columns(data)})")
    completions = {side: data[key] for side, key in keys.items()}
    if cfg.prompt_key in data:
        prompt = data[cfg.prompt_key]
    elif all(_is_chat(c) for c in completions.values()):  # implicit prompt: the conversations' shared head
        prompt = completions["chosen"][:-1]
        if not prompt or completions["rejected"][:-1] != prompt:
            raise ValueError(f"no prompt column {cfg.prompt_key!r}, and chosen and rejected differ before their last message")
        completions = {side: c[-1:] for side, c in completions.items()}
    else:
        raise ValueError(f"no prompt column {cfg.prompt_key!r} (columns: {_columns(data)})")
    chat = _is_chat(prompt)
    _check_no_clash(data, cfg)
    _check_text_or_chat(prompt, cfg.prompt_key)
    for side, completion in completions.items():
        _check_text_or_chat(completion, keys[side])
    fields = {k: v for k, v in data.items() if k not in (cfg.prompt_key, *keys.values())}
    fields |= {side: render.completion(prompt, chat, c) for side, c in completions.items()}
    fields["answer"] = _answer(data, cfg, required=False)
    return Problem(prompt=render.prompt(prompt, chat), answer=fields["answer"], fields=fields)


def _check_text_or_chat(value: Any, key: str) -> None:
    if _is_chat(value) or (isinstance(value, str) and value.strip()):
        return
    got = "an empty string" if isinstance(value, str) else type(value).__name__
    raise ValueError(f"column {key!r} must be a non-empty string or chat messages [{{role, content}}, ...], got {got}")


def load_split(
    rows: list[Row], cfg: DatasetConfig, parse: Callable[[Any], Problem], count_tokens: Callable[[str], int]
) -> Loaded:
    """`parse` each row into a `Problem`; malformed rows (ValueError) and too long prompts are counted."""
    out = Loaded(rows=len(rows))
    for row in rows:
        try:
            if isinstance(row.data, _Bad):
                raise ValueError(row.data.reason)
            problem = parse(row.data)
        except ValueError as err:
            out.bad.append(f"{row.where}: {err}")
            continue
        if count_tokens(problem.prompt) > cfg.max_prompt_tokens:
            out.too_long += 1
            continue
        out.problems.append(problem)
    return out


def check_bad_rows(loaded: Loaded, cfg: DatasetConfig, what: str) -> None:
    """Stop when more than `max_bad_fraction` of the rows are malformed; else report them."""
    if not loaded.bad:
        return
    shown = "\n".join(f"  {line}" for line in loaded.bad[:SHOWN_ERRORS])
    more = f"\n  ... and {len(loaded.bad) - SHOWN_ERRORS} more" if len(loaded.bad) > SHOWN_ERRORS else ""
    head = f"{what}: {len(loaded.bad)} of {loaded.rows} rows are malformed"
    if len(loaded.bad) > cfg.max_bad_fraction * loaded.rows:
        raise DatasetError(f"{head} (task.dataset.max_bad_fraction={cfg.max_bad_fraction}):\n{shown}{more}")
    print(f"warning: {head}; skipped them:\n{shown}{more}", file=sys.stderr)


class DatasetTask(Task):
    """A task made of the user's rows: train problems streamed in seeded shuffled epochs,
    held-out problems in file order."""

    name = "dataset"

    def __init__(self, train: list[Problem], heldout: list[Problem], report: dict):
        if not train:
            raise DatasetError(f"the dataset has no train prompts left ({report})")
        if not heldout:
            raise DatasetError(f"the dataset has no held-out prompts ({report}); set task.dataset.heldout_path")
        self.problems = {"train": train, "heldout": heldout}
        self.report = report

    def sample(self, n: int, split: Split, seed: int = 0) -> list[Problem]:
        """The first `n` problems of `split` (all of them when it has fewer)."""
        return self.problems[split][:n]

    def stream(self, split: Split, seed: int = 0):
        rng = random.Random(f"dataset:stream:{split}:{seed}")
        while True:
            epoch = list(self.problems[split])
            rng.shuffle(epoch)
            yield from epoch


@dataclass(frozen=True)
class Renderer:
    """How a dataset's prompts and completions become text: `prompt(prompt, is_chat)` and
    `completion(prompt, is_chat, completion)`, through the model's chat template where the
    config says so."""

    prompt: Callable[[Any, bool], str]
    completion: Callable[[Any, bool, Any], str]


def renderer(cfg: DatasetConfig, tokenizer) -> Renderer:
    """The `Renderer` of `cfg` with `tokenizer` (the model's)."""
    template_text = cfg.chat_template or tokenizer.chat_template  # the tokenizer itself is left as it is
    # The engines tokenize prompts with the tokenizer's special tokens; a template that writes the
    # BOS token itself would give two of them, so it is dropped from the text when the tokenizer adds one.
    bos = tokenizer.bos_token
    drop_bos = bool(bos) and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]

    def template(messages: list, generation_prompt: bool) -> str:
        if template_text is None:
            raise DatasetError(
                "the model's tokenizer has no chat template; give one in task.dataset.chat_template, "
                "or use plain string prompts with apply_chat_template: false"
            )
        text = tokenizer.apply_chat_template(
            messages, chat_template=template_text, tokenize=False, add_generation_prompt=generation_prompt
        )
        return text.removeprefix(bos) if drop_bos else text

    def messages(prompt: Any, chat: bool) -> list | None:
        """The prompt as chat messages when it goes through the template, else None."""
        if not (cfg.apply_chat_template if cfg.apply_chat_template is not None else chat):
            if chat:
                raise ValueError("chat messages need a chat template; set task.dataset.apply_chat_template: true")
            return None
        return prompt if chat else [{"role": "user", "content": prompt}]

    def render_prompt(prompt: Any, chat: bool) -> str:
        as_chat = messages(prompt, chat)
        return prompt if as_chat is None else template(as_chat, generation_prompt=True)

    def render_completion(prompt: Any, chat: bool, completion: Any) -> str:
        """A completion given as assistant messages is the template's text after the prompt's."""
        if not _is_chat(completion):
            return completion
        as_chat = messages(prompt, chat)
        if as_chat is None:
            raise ValueError("chat-message completions need a chat template; set task.dataset.apply_chat_template: true")
        head, whole = template(as_chat, generation_prompt=True), template([*as_chat, *completion], generation_prompt=False)
        if not whole.startswith(head):
            raise ValueError(
                "the chat template renders the conversation with another start than the prompt alone; "
                "give the completions as strings"
            )
        return whole[len(head) :]

    return Renderer(render_prompt, render_completion)


def load_dataset_task(cfg: DatasetConfig, tokenizer, preferences: bool = False) -> DatasetTask:
    """The task `cfg` describes, prompts rendered and counted with `tokenizer` (the model's);
    with `preferences`, rows are preference pairs (DPO: `preference_problem`)."""
    render = renderer(cfg, tokenizer)
    if preferences:
        parse = functools.partial(preference_problem, cfg=cfg, render=render)
    else:
        parse = functools.partial(row_problem, cfg=cfg, render=render.prompt)

    def count_tokens(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    rows, splits = read_rows(cfg.path, cfg.train_split)
    if not rows:
        raise DatasetError(f"task.dataset.path {cfg.path!r} has no {cfg.train_split!r} rows (its splits: {splits})")
    if cfg.heldout_path is not None:
        heldout_rows, heldout_from = read_rows(cfg.heldout_path, None)[0], f"heldout_path {cfg.heldout_path!r}"
    else:
        split = cfg.heldout_split or next((s for s in HELDOUT_SPLITS if s in splits), None)
        if cfg.heldout_split and cfg.heldout_split not in splits:
            raise DatasetError(f"task.dataset.heldout_split {cfg.heldout_split!r}: the dataset's splits are {splits}")
        heldout_rows = read_rows(cfg.path, split)[0] if split else []
        heldout_from = f"split {split!r}" if split else f"{cfg.heldout_percent}% of the prompts by hash"
    train = load_split(rows, cfg, parse, count_tokens)
    check_bad_rows(train, cfg, f"task.dataset.path {cfg.path!r}")
    if heldout_rows:
        heldout = load_split(heldout_rows, cfg, parse, count_tokens)
        check_bad_rows(heldout, cfg, f"held-out ({heldout_from})")
    else:  # a stable hashed share of the prompts, as the built-in tasks split theirs
        heldout = Loaded(problems=[p for p in train.problems if in_heldout(p.prompt, cfg.heldout_percent)])
        train.problems = [p for p in train.problems if not in_heldout(p.prompt, cfg.heldout_percent)]
    report = {
        "train": len(train.problems),
        "heldout": len(heldout.problems),
        "heldout_from": heldout_from,
        "malformed_skipped": len(train.bad) + len(heldout.bad),
        "too_long_dropped": train.too_long + heldout.too_long,
    }
    if report["too_long_dropped"]:
        print(
            f"warning: {report['too_long_dropped']} prompts longer than task.dataset.max_prompt_tokens="
            f"{cfg.max_prompt_tokens} tokens were dropped",
            file=sys.stderr,
        )
    return DatasetTask(train.problems, heldout.problems, report)


def load_task(cfg: RaypoConfig, model_dir: str | Path, preferences: bool | None = None) -> Task:
    """The task a run trains and evaluates on: the user's dataset (prompts rendered with the
    tokenizer in `model_dir`) or the built-in task of `task.task`. A dataset's rows are
    preference pairs when `preferences` says so (None: when the algorithm samples nothing, DPO)."""
    if cfg.task.dataset is None:
        return task_from_config(cfg.task.task)
    from transformers import AutoTokenizer  # heavy: only a dataset's prompts need the tokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    pairs = not cfg.algo.generates if preferences is None else preferences
    return load_dataset_task(cfg.task.dataset, tokenizer, preferences=pairs)


def eval_max_tokens(cfg: RaypoConfig, problems: list[Problem]) -> int:
    """Longest evaluated completion: `eval.max_tokens`, else a built-in answer's length + 2,
    else `inference.max_tokens`."""
    if cfg.eval.max_tokens is not None:
        return cfg.eval.max_tokens
    if cfg.task.dataset is None:
        return max(len(p.answer or "") for p in problems) + 2
    return cfg.inference.max_tokens

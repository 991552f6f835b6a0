import pytest

from pipelines.data.rewards import exact_match, load_reward, score
from pipelines.data.tasks import Arithmetic, Reverse, make_task


def test_arithmetic_answers_are_exact():
    for problem in Arithmetic(min_operand=0, max_operand=30, operators="+-*").sample(300, "train"):
        expression = problem.prompt.removesuffix("=")
        assert str(eval(expression)) == problem.answer  # the prompt is a Python expression


def test_reverse_answers_are_reversed():
    for problem in Reverse(min_length=3, max_length=3).sample(50, "heldout"):
        text = problem.prompt.removeprefix("rev ").removesuffix("=")
        assert len(text) == 3 and problem.answer == text[::-1]


@pytest.mark.parametrize("task", [Arithmetic(), Reverse()])
def test_splits_are_disjoint_and_deterministic(task):
    train = {p.prompt for p in task.sample(2000, "train", seed=0)}
    heldout = {p.prompt for p in task.sample(500, "heldout", seed=0)}
    assert len(train) == 2000 and len(heldout) == 500
    assert not train & heldout
    assert [p.prompt for p in task.sample(20, "heldout", seed=0)] == [p.prompt for p in task.sample(20, "heldout", seed=0)]
    assert task.sample(20, "train", seed=0) != task.sample(20, "train", seed=1)
    # the stream of RL prompts never leaves its split either
    stream = task.stream("train", seed=3)
    assert not {next(stream).prompt for _ in range(500)} & heldout


def test_task_options_are_checked():
    with pytest.raises(ValueError, match="operators must be drawn from"):
        Arithmetic(operators="/")
    with pytest.raises(ValueError, match="min_operand <= max_operand"):
        Arithmetic(min_operand=5, max_operand=1)
    with pytest.raises(ValueError, match="fewer than 500 distinct heldout problems"):
        Arithmetic(min_operand=0, max_operand=3, operators="+").sample(500, "heldout")
    with pytest.raises(ValueError, match="bad options for task 'reverse'"):
        make_task("reverse", max_operand=3)
    with pytest.raises(KeyError, match="unknown task 'sudoku'"):
        make_task("sudoku")


def test_builtin_rewards_by_name():
    fn = load_reward("exact_match")
    assert fn is exact_match
    # surrounding whitespace is stripped; anything else must match exactly
    assert fn(["1+1="] * 4, ["2", " 2 ", " 2\n", "3"], answer=["2"] * 4) == [1.0, 1.0, 1.0, 0.0]
    assert load_reward("answer_format")(["p"] * 3, ["12", "1 2", "1=2"]) == [1.0, 0.0, 0.0]


def test_user_reward_from_a_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def shorter_is_better(prompts, completions, **fields):\n"
        "    return [1.0 / (1 + len(c)) if c else None for c in completions]\n"
    )
    fn = load_reward(f"{path}:shorter_is_better")
    assert score(fn, ["p", "p"], ["abc", ""], name="mine") == [0.25, None]


def test_user_reward_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_reward(f"{tmp_path}/nope.py:f")
    path = tmp_path / "r.py"
    path.write_text(
        "x = 1\ndef two_args(a):\n    return []\ndef boom(prompts, completions, **k):\n    raise KeyError('answer')\n"
    )
    with pytest.raises(AttributeError, match="has no function 'missing'"):
        load_reward(f"{path}:missing")
    with pytest.raises(TypeError, match="is not callable"):
        load_reward(f"{path}:x")
    with pytest.raises(TypeError, match=r"must accept \(prompts, completions, \*\*fields\)"):
        load_reward(f"{path}:two_args")
    path.write_text(path.read_text() + "def needs_target(prompts, completions, target):\n    return [1.0 for _ in completions]\n")
    needs_target = load_reward(f"{path}:needs_target")  # a column asked for by name loads ...
    assert score(needs_target, ["p"], ["c"], name="t", target=["x"]) == [1.0]
    with pytest.raises(
        TypeError, match=r"reward 't' cannot take this data's columns \(answer\): missing a required argument: 'target'"
    ):
        score(needs_target, ["p"], ["c"], name="t", answer=["x"])  # ... and fails naming it where the data lacks it
    with pytest.raises(RuntimeError, match="reward 'boom' raised KeyError"):
        score(load_reward(f"{path}:boom"), ["p"], ["c"], name="boom")
    syntax = tmp_path / "broken.py"
    syntax.write_text("def f(:\n")
    with pytest.raises(ImportError, match="failed to import: SyntaxError"):
        load_reward(f"{syntax}:f")


def test_score_checks_what_a_reward_returns():
    with pytest.raises(ValueError, match="returned 1 scores for 2 completions"):
        score(lambda p, c, **k: [1.0], ["a", "b"], ["x", "y"], name="short")
    with pytest.raises(TypeError, match="returned str at index 0"):
        score(lambda p, c, **k: ["1"], ["a"], ["x"], name="text")

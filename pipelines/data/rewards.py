"""Reward functions: plain callables `(prompts, completions, **fields) -> list[float | None]`.

`fields` are the dataset's other columns (for the built-in tasks: `answer`), one list entry
per completion. `None` means "this function does not score this sample". A user's reward is
named in config as `path/to/file.py:function`; built-in ones by name.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pipelines.registry import Registry

RewardFn = Callable[..., list[float | None]]
REWARDS: Registry[RewardFn] = Registry("reward function")


@REWARDS.register("exact_match")
def exact_match(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str | None], **_) -> list[float | None]:
    """1.0 when the completion, stripped of surrounding whitespace, is exactly the answer.

    >>> exact_match(["2+2="], [" 4"], answer=["4"])
    [1.0]
    >>> exact_match(["2+2=", "rev ab="], ["5", "ba"], answer=["4", None])
    [0.0, None]
    """
    return [None if ref is None else float(text.strip() == ref) for text, ref in zip(completions, answer, strict=True)]


@REWARDS.register("answer_format")
def answer_format(prompts: Sequence[str], completions: Sequence[str], **_) -> list[float | None]:
    """1.0 when the completion is a single non-empty token-free line (no spaces, no '=').

    >>> answer_format(["1+1="], ["2"]), answer_format(["1+1="], ["2=3"])
    ([1.0], [0.0])
    """
    return [float(bool(c.strip()) and " " not in c.strip() and "=" not in c) for c in completions]


def load_reward(spec: str) -> RewardFn:
    """A reward by registered name (`exact_match`) or as `path/to/file.py:function`.

    Errors name the file or function that is missing or not callable.
    """
    if ":" not in spec:
        return REWARDS.get(spec)
    path_text, _, func_name = spec.rpartition(":")
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"reward file {str(path)!r} (from {spec!r}) does not exist")
    module_name = f"raypo_user_reward_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"reward file {str(path)!r} cannot be imported as Python")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        raise ImportError(f"reward file {str(path)!r} failed to import: {type(err).__name__}: {err}") from err
    fn = getattr(module, func_name, None)
    if fn is None:
        raise AttributeError(f"reward file {str(path)!r} has no function {func_name!r}")
    if not callable(fn):
        raise TypeError(f"{spec!r} is not callable")
    _check_signature(fn, spec)
    return fn


def _check_signature(fn: RewardFn, spec: str) -> None:
    # Partial: a reward may require dataset columns by name (`answer`, `target`), which
    # `score` checks against the columns the batch has.
    try:
        inspect.signature(fn).bind_partial(["p"], ["c"])
    except TypeError as err:
        raise TypeError(f"reward {spec!r} must accept (prompts, completions, **fields): {err}") from None


def _check_columns(fn: RewardFn, name: str, fields: dict) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without a signature (a C function): nothing to check
        return
    try:
        signature.bind(["p"], ["c"], **fields)
    except TypeError as err:
        raise TypeError(
            f"reward {name!r} cannot take this data's columns ({', '.join(fields) or 'none'}): {err}; "
            "its arguments after (prompts, completions) must be column names, with **fields for the rest"
        ) from None


def score(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str], name: str = "reward", **fields) -> list[float | None]:
    """Call a reward function and check what it returns: one float or None per completion."""
    _check_columns(fn, name, fields)
    try:
        out = list(fn(list(prompts), list(completions), **fields))
    except Exception as err:
        raise RuntimeError(f"reward {name!r} raised {type(err).__name__}: {err}") from err
    if len(out) != len(completions):
        raise ValueError(f"reward {name!r} returned {len(out)} scores for {len(completions)} completions")
    for i, value in enumerate(out):
        if value is not None and not isinstance(value, (int, float)):
            raise TypeError(f"reward {name!r} returned {type(value).__name__} at index {i}; expected float or None")
        if value is not None and not math.isfinite(value):
            raise ValueError(f"reward {name!r} returned {value} at index {i}; return a finite float, or None for 'not scored'")
    return [None if v is None else float(v) for v in out]

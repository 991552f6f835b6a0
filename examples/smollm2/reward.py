"""Rewards for the SmolLM2 example: plain callables `(prompts, completions, **columns)`, as
raypo (and TRL) call them. `answer` is the dataset's answer column, one per completion."""

import re

NUMBER = re.compile(r"-?\d+")


def correct(prompts, completions, answer, **_):
    """1.0 when the last number in the completion is the answer ("12 + 7 = 19" counts).

    >>> correct(["q", "q", "q"], ["19", "12 + 7 = 19.", "It is 18"], answer=["19", "19", "19"])
    [1.0, 1.0, 0.0]
    """
    found = [NUMBER.findall(c) for c in completions]
    return [float(bool(nums) and nums[-1] == a) for nums, a in zip(found, answer, strict=True)]


def number_only(prompts, completions, **_):
    """1.0 when the completion is just a number, as the prompt asks.

    >>> number_only(["q", "q"], [" 19", "12 + 7 = 19"])
    [1.0, 0.0]
    """
    return [float(re.fullmatch(r"\s*-?\d+\.?\s*", c) is not None) for c in completions]

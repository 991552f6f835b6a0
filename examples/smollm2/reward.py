"""Rewards for the SmolLM2 example: plain callables `(prompts, completions, **columns)`, as
raypo (and TRL) call them. `answer` is the dataset's answer column, one per completion."""

import re

NUMBER = re.compile(r"-?\d+")
ONE_LINE_ENDING_IN_A_NUMBER = re.compile(r"[^\n]*?-?\d+\.?")


def correct(prompts, completions, answer, **_):
    """1.0 when the last number in the completion is the answer ("12 + 7 = 19" counts).

    >>> correct(["q", "q", "q"], ["19", "12 + 7 = 19.", "It is 18"], answer=["19", "19", "19"])
    [1.0, 1.0, 0.0]
    """
    found = [NUMBER.findall(c) for c in completions]
    return [float(bool(nums) and nums[-1] == a) for nums, a in zip(found, answer, strict=True)]


def answer_last(prompts, completions, **_):
    """1.0 when the answer is one line that ends with a number: "12 + 7 = 19" or "19", with no
    explanation after it. The prompt asks for the number only; this term asks less, so the model
    keeps writing the sum out, which it needs to get it right (a bare number cost correctness).

    >>> answer_last(["q"] * 4, [" 19", "12 + 7 = 19.", "12 + 7 = 19\\n\\nThis is a classic example", "Nineteen"])
    [1.0, 1.0, 0.0, 0.0]
    """
    return [float(ONE_LINE_ENDING_IN_A_NUMBER.fullmatch(c.strip()) is not None) for c in completions]

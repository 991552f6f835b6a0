"""The docstring examples run (and each listed module has some), and the tree is ruff-clean
(complexity rule on)."""

import doctest
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Every module with a docstring example. A module listed here must hold one; one that gains an
# example must be listed (the last test), so no example goes unrun.
MODULES_WITH_EXAMPLES = [
    "actors.common",
    "actors.core.minibatch",
    "actors.core.modeling",
    "actors.core.reward",
    "actors.weight_sync",
    "pipelines.algos.advantages",
    "pipelines.algos.losses",
    "pipelines.algos.sampling",
    "pipelines.algos.schedules",
    "pipelines.cluster",
    "pipelines.config",
    "pipelines.data.dataset",
    "pipelines.data.evaluate",
    "pipelines.data.preferences",
    "pipelines.data.rewards",
    "pipelines.data.storage",
    "pipelines.data.tasks",
    "pipelines.models.sft",
    "pipelines.models.vllm_engine",
    "pipelines.rl.monitor",
    "pipelines.rl.roles",
    "pipelines.rl.recovery",
    "pipelines.rl.trainer",
    "pipelines.rl.tune",
    "serve.app",
    "serve.ingress",
]


@pytest.mark.parametrize("name", MODULES_WITH_EXAMPLES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} is listed but has no docstring example"
    assert result.failed == 0


def test_every_module_with_examples_is_listed():
    with_examples = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for package in ("actors", "pipelines", "serve")
        for path in (ROOT / package).rglob("*.py")
        if ">>> " in path.read_text()
    }
    assert with_examples == set(MODULES_WITH_EXAMPLES)


def test_ruff_is_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr

"""The layers of the house, checked on the source: every import statement (at module top or
inside a function) of every file of actors/, pipelines/ and serve/.

    pipelines.algos, pipelines.data      pure: neither Ray nor actors, nothing above them
    pipelines.models                     no actors, nothing of rl/ or the CLI
    actors                               may use algos, data, models; never pipelines.rl or the CLI
    pipelines.rl                         the only part of pipelines that imports actors
    pipelines.config, pipelines.registry leaves: nothing of pipelines above them, no Ray, no actors
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, by absolute name (relative imports resolved)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _module(path) if path.name == "__init__.py" else _module(path).rsplit(".", 1)[0]
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pipelines import rl`
    return names


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


# (files of this package, the modules they must never import, why)
RULES = [
    ("pipelines.algos", ["ray", "actors", "pipelines.data", "pipelines.models", "pipelines.rl", "pipelines.cli"], "pure math"),
    ("pipelines.data", ["ray", "actors", "pipelines.models", "pipelines.rl", "pipelines.cli"], "pure data"),
    ("pipelines.models", ["ray", "actors", "pipelines.rl", "pipelines.cli"], "model files, no actors"),
    ("pipelines.config", ["ray", "actors", "pipelines.data", "pipelines.models", "pipelines.rl", "pipelines.cli"], "a leaf"),
    ("pipelines.registry", ["ray", "actors", "pipelines"], "a leaf"),
    ("actors", ["pipelines.rl", "pipelines.cli", "serve"], "actors sit below the driver"),
    ("serve", ["pipelines.rl"], "serving knows no training driver"),
]


def _files(package: str) -> list[Path]:
    path = ROOT.joinpath(*package.split("."))
    return sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


def wrong_arrows(package: str, forbidden: list[str]) -> list[str]:
    found = []
    for path in _files(package):
        for name in sorted(imports_of(path)):
            if any(_under(name, bad) for bad in forbidden) and not _under(name, package):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


@pytest.mark.parametrize("package, forbidden, why", RULES, ids=[rule[0] for rule in RULES])
def test_no_import_runs_against_the_layers(package, forbidden, why):
    assert _files(package), f"no files for {package}"
    assert wrong_arrows(package, forbidden) == [], why


def test_only_rl_imports_actors_within_pipelines():
    outside_rl = [p for p in _files("pipelines") if not _under(_module(p), "pipelines.rl")]
    wrong = [f"{p.relative_to(ROOT)} imports {n}" for p in outside_rl for n in sorted(imports_of(p)) if _under(n, "actors")]
    assert wrong == []


def test_the_check_sees_a_wrong_arrow(tmp_path):
    """The walk finds an import inside a function as well as at the top (a test that can fail)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import numpy\n\ndef f():\n    from actors.learner import LearnerGroup\n    import ray.util\n")
    assert {"actors.learner", "actors.learner.LearnerGroup", "ray.util"} <= imports_of(bad)

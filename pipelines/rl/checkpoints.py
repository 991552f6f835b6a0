"""A run's checkpoints: checkpoints/step_N (the learners' policy, optimizer and step state,
the critic for PPO, the trainer's state) and a `latest` pointer, written so that a crash
mid-save leaves the previous checkpoint the valid latest one."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import ray

from pipelines.rl.roles import Roles


def latest_checkpoint(root: Path) -> Path | None:
    pointer = root / "latest"
    return root / pointer.read_text().strip() if pointer.exists() else None


def save_checkpoint(roles: Roles, root: Path, step: int, state: dict) -> Path:
    """Write root/step_N atomically (tmp dir, rename, then the `latest` pointer)."""
    name = f"step_{step:06d}"
    tmp = root / f"{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    roles.learners.run("save_checkpoint", str(tmp))
    if roles.value is not None:
        ray.get(roles.value.save.remote(str(tmp / "critic")))
    (tmp / "trainer_state.json").write_text(json.dumps({**state, "step": step}))
    final = root / name
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    pointer_tmp = root / "latest.tmp"
    pointer_tmp.write_text(name)
    os.replace(pointer_tmp, root / "latest")
    return final


def load_checkpoint(roles: Roles, path: Path) -> dict:
    """Restore the learners (and critic) from `path`, push its weights to the engines; the trainer's state."""
    roles.learners.run("load_checkpoint", str(path))
    if roles.value is not None:
        ray.get(roles.value.load.remote(str(path / "critic")))
    state = json.loads((path / "trainer_state.json").read_text())
    roles.weight_sync.push(state["step"])
    return state

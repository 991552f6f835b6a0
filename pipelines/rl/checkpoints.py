"""A run's checkpoints: checkpoints/step_N (the learners' policy, optimizer and step state, the
critic for PPO, the refreshed reward model, the trainer's state) under the run's storage
location (a directory, or a URI: pipelines.data.storage), the last `keep` of them.

Each role writes its own files there from the node it runs on. Then the driver checksums every
file into MANIFEST.json, written last: a checkpoint without one, or whose files differ from it,
is not whole, and --resume skips it for the newest one that is. On a local directory the files
are fsynced and the checkpoint is written under a temporary name and renamed (a step saved
again replaces the old one only once the new one is whole)."""

from __future__ import annotations

import json

import ray

from pipelines.data import storage
from pipelines.rl.roles import Roles


def save_checkpoint(roles: Roles, root: str, step: int, state: dict, keep: int = 0, protect: int | None = None) -> str:
    """Write root/step_N whole (see the module's docstring), point `latest` at it and keep the
    newest `keep` checkpoints (0: all), and also the newest one of step `protect` or before (what
    a rollback would go back to). Returns its location."""
    name = f"step_{step:06d}"
    final = storage.join(root, name)
    local = not storage.is_uri(root)
    target = storage.join(root, f"{name}.tmp") if local else final
    storage.remove_dir(target)  # a crashed save's leftovers, or another learner count's shards
    roles.learners.run("save_checkpoint", target)
    if storage.read_text(storage.join(target, "policy", "config.json")) is None:
        raise storage.StorageError(
            f"the learners wrote checkpoint {target!r} on their own node, where the driver cannot see it: set "
            "training.storage_path to a directory every node shares, or to a URI (s3://, gs://)"
        )
    extras = [roles.reward.save.remote(storage.join(target, "reward"))]
    if roles.value is not None:
        extras.append(roles.value.save.remote(storage.join(target, "critic")))
    ray.get(extras)
    storage.write_text(storage.join(target, "trainer_state.json"), json.dumps({**state, "step": step}))
    storage.write_manifest(target)
    if local:
        storage.replace_dir(target, final)
    storage.write_text(storage.join(root, "latest"), name)
    if keep:
        others = [n for n in storage.step_dirs(root) if n != name]
        kept = next((n for n in others if storage.step_of(n) <= protect), None) if protect is not None else None
        for old in others[keep - 1 :]:
            if old != kept:
                storage.remove_dir(storage.join(root, old))
    return final


def load_checkpoint(roles: Roles, location: str) -> dict:
    """Restore the learners (their learning-rate scale too), critic and reward model from
    `location` and push its weights to the engines; returns the trainer's state."""
    roles.learners.run("load_checkpoint", location)
    extras = [roles.reward.load.remote(storage.join(location, "reward"))]
    if roles.value is not None:
        extras.append(roles.value.load.remote(storage.join(location, "critic")))
    ray.get(extras)
    text = storage.read_text(storage.join(location, "trainer_state.json"))
    if text is None:
        raise FileNotFoundError(f"checkpoint {location!r} has no trainer_state.json")
    state = json.loads(text)
    roles.learners.run("set_lr_scale", state.get("lr_scale", 1.0))  # lowered by a rollback before the checkpoint
    roles.weight_sync.push(state["step"])
    return state

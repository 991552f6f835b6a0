"""A run's checkpoints: checkpoints/step_N (the learners' policy, optimizer and step state,
the critic for PPO, the trainer's state) and a `latest` pointer, under the run's storage
location (a directory, or a URI: pipelines.data.storage).

Each role writes its own files there from the node it runs on. On a local directory a
checkpoint is written under a temporary name and renamed; on a URI (no rename) the `latest`
pointer, written last, is what makes it the one --resume takes."""

from __future__ import annotations

import json

import ray

from pipelines.data import storage
from pipelines.rl.roles import Roles


def latest_checkpoint(root: str) -> str | None:
    name = storage.read_text(storage.join(root, "latest"))
    return storage.join(root, name.strip()) if name else None


def save_checkpoint(roles: Roles, root: str, step: int, state: dict) -> str:
    """Write root/step_N (tmp dir and rename where the storage is local), then the `latest` pointer."""
    name = f"step_{step:06d}"
    final = storage.join(root, name)
    target = final if storage.is_uri(root) else storage.join(root, f"{name}.tmp")
    storage.remove_dir(target)  # a crashed save's leftovers, or another learner count's shards
    roles.learners.run("save_checkpoint", target)
    if storage.read_text(storage.join(target, "policy", "config.json")) is None:
        raise storage.StorageError(
            f"the learners wrote checkpoint {target!r} on their own node, where the driver cannot see it: set "
            "training.storage_path to a directory every node shares, or to a URI (s3://, gs://)"
        )
    if roles.value is not None:
        ray.get(roles.value.save.remote(storage.join(target, "critic")))
    storage.write_text(storage.join(target, "trainer_state.json"), json.dumps({**state, "step": step}))
    if not storage.is_uri(root):
        storage.remove_dir(final)
        storage.local_path(target).rename(storage.local_path(final))
    storage.write_text(storage.join(root, "latest"), name)
    return final


def load_checkpoint(roles: Roles, location: str) -> dict:
    """Restore the learners (and critic) from `location`, push its weights to the engines; the trainer's state."""
    roles.learners.run("load_checkpoint", location)
    if roles.value is not None:
        ray.get(roles.value.load.remote(storage.join(location, "critic")))
    text = storage.read_text(storage.join(location, "trainer_state.json"))
    if text is None:
        raise FileNotFoundError(f"checkpoint {location!r} has no trainer_state.json")
    state = json.loads(text)
    roles.weight_sync.push(state["step"])
    return state

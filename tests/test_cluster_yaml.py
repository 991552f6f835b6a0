"""cluster.yaml passes Ray's own schema offline, names node types by role, and comments every key."""

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster.yaml"


def test_cluster_yaml_is_valid_for_ray():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(yaml.safe_load(CLUSTER.read_text()))
    validate_config(config)
    assert {"learner", "rollout"} <= set(config["available_node_types"])


def test_a_broken_cluster_yaml_is_rejected():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(CLUSTER.read_text())
    config["available_node_types"]["learner"]["max_workers"] = "two"
    with pytest.raises(Exception, match="two"):
        validate_config(prepare_config(config))


def test_every_key_line_has_a_comment():
    for number, line in enumerate(CLUSTER.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and stripped.split(":")[0].replace("-", "").strip().isidentifier():
            assert "#" in line, f"cluster.yaml line {number} has no comment: {line!r}"


def test_the_fake_cluster_has_cluster_yamls_node_types_and_passes_rays_schema():
    from ray.autoscaler._private.util import validate_config

    from pipelines.cluster import launcher_config

    fake, head = launcher_config(yaml.safe_load((ROOT / "configs" / "fake_cluster.yaml").read_text()))
    validate_config(fake)  # prepare_config needs the fake provider's example.yaml, which the wheel lacks
    real = yaml.safe_load(CLUSTER.read_text())["available_node_types"]
    workers = {name: spec for name, spec in fake["available_node_types"].items() if name != "ray.head.default"}
    assert set(workers) == set(real) - {"head"}
    for name, spec in workers.items():  # the same role resources as cluster.yaml, plus CPUs of this machine
        assert {k: v for k, v in spec["resources"].items() if k != "CPU"} == real[name]["resources"]
    cpus = head.get("CPU", 0) + sum(spec["resources"]["CPU"] * spec["max_workers"] for spec in workers.values())
    assert cpus == 2  # no more logical CPUs than the 2 cores of the smallest machine raypo runs on


def test_each_role_is_pinned_to_its_node_type_only_where_nodes_advertise_one():
    from pipelines.config import load_config
    from pipelines.rl.roles import cluster_has_node_types, resource_plan

    cfg = load_config(ROOT / "configs" / "ppo_tiny.yaml")
    pinned = {b.role: b.resources for b in resource_plan(cfg, by_node_type=True)}
    assert pinned["learner-0"]["raypo_node:learner"] == pinned["value"]["raypo_node:learner"] == 0.001
    assert pinned["rollout-0"]["raypo_node:rollout"] == 0.001
    assert not any(k.startswith("raypo_node:") for k in pinned["reward"]) and not any(
        k.startswith("raypo_node:") for k in pinned["buffer"]
    )
    assert not any(k.startswith("raypo_node:") for b in resource_plan(cfg) for k in b.resources)
    assert cluster_has_node_types({"CPU": 2.0, "raypo_node:rollout": 1000.0}) and not cluster_has_node_types({"CPU": 2.0})

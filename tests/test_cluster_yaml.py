"""cluster.yaml passes Ray's own schema offline, names node types by role, and comments every key."""

from pathlib import Path

import pytest
import yaml

CLUSTER = Path(__file__).resolve().parent.parent / "cluster.yaml"


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

from pathlib import Path

import pytest

from pipelines.config import ConfigError, RaypoConfig, load_config, parse_cpu_list

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_defaults_follow_the_seeds():
    cfg = RaypoConfig()
    assert (cfg.algo.gamma, cfg.algo.lam, cfg.algo.clip_eps) == (0.99, 0.95, 0.2)
    assert (cfg.algo.entropy_coef, cfg.algo.kl_coef) == (0.01, 0.001)
    assert (cfg.training.grad_clip, cfg.training.lr) == (1.0, 3e-5)
    assert (cfg.monitor.grad_norm_alert, cfg.monitor.kl_alert) == (1.5, 0.02)
    assert cfg.reward.normalize is True


def test_seed_example_loads_as_is():
    cfg = load_config(CONFIGS / "seed_example.yaml")
    assert cfg.training.batch_size == 128
    assert (cfg.algo.group_size, cfg.algo.gamma, cfg.algo.clip_eps) == (8, 0.99, 0.2)
    assert (cfg.inference.max_tokens, cfg.inference.temperature, cfg.inference.top_p) == (2048, 0.7, 0.9)
    assert cfg.resource.gpu_memory_fraction == 0.8
    assert cfg.resource.cpu_affinity == list(range(16))


# configs/ also holds sweep files (tune_*.yaml, read by raypo tune) and the fake cluster's file
RUN_PRESETS = sorted(p.name for p in CONFIGS.glob("*.yaml") if not p.name.startswith("tune_") and p.name != "fake_cluster.yaml")


@pytest.mark.parametrize("preset", RUN_PRESETS)
def test_every_preset_loads(preset):
    assert isinstance(load_config(CONFIGS / preset), RaypoConfig)


@pytest.mark.parametrize("sweep", sorted(p.name for p in CONFIGS.glob("tune_*.yaml")))
def test_every_sweep_file_loads_with_its_space_checked(sweep):
    from pipelines.rl.tune import load_sweep

    cfg, base = load_sweep(CONFIGS / sweep)
    assert base.is_file() and cfg.space


def test_dotted_overrides_are_typed_by_yaml():
    cfg = load_config(CONFIGS / "grpo_tiny.yaml", ["algo.clip_eps=0.1", "reward.normalize=false", "name=x y"])
    assert cfg.algo.clip_eps == 0.1 and cfg.reward.normalize is False and cfg.name == "x y"
    cfg = load_config(None, ["task.task.name=reverse", "task.task.max_length=4"])
    assert cfg.task.task.name == "reverse" and cfg.task.task.max_length == 4


def test_the_engines_take_the_model_dtype_unless_inference_names_their_own():
    assert load_config(CONFIGS / "grpo_tiny.yaml").engine_dtype == "float32"
    assert load_config(CONFIGS / "grpo_tiny.yaml", ["model.dtype=bfloat16"]).engine_dtype == "bfloat16"
    cfg = load_config(CONFIGS / "grpo_tiny.yaml", ["inference.dtype=bfloat16"])
    assert (cfg.model.dtype, cfg.engine_dtype) == ("float32", "bfloat16")
    assert load_config(CONFIGS / "grpo_tiny.yaml", ["model.dtype=bfloat16", "inference.dtype=float32"]).engine_dtype == "float32"
    assert load_config(CONFIGS / "grpo_tiny.yaml", ["inference.dtype="]).engine_dtype == "float32"  # empty: the model's


def test_config_is_frozen():
    cfg = RaypoConfig()
    with pytest.raises(Exception, match="frozen"):
        cfg.algo.clip_eps = 0.3


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.clip_epsilon=0.1"], r"algo\.clip_epsilon: unknown key"),
        (["algo.clip_eps=-1"], r"algo\.clip_eps: Input should be greater than 0"),
        (["training.steps=many"], r"training\.steps: Input should be a valid integer"),
        (["algo.advantage=ppo2"], r"algo\.advantage: unknown advantage estimator 'ppo2'"),
        (["algo.policy_loss=trpo"], r"algo\.policy_loss: unknown policy loss 'trpo'"),
        (["resource.cpu_affinity=[0-x]"], r"resource\.cpu_affinity: CPU id must be an integer or a range"),
        (["task.task.name=sudoku"], r"task\.task: Input tag 'sudoku'"),
        (["task.task.max_operand=-3"], r"task\.task\.max_operand: Input should be greater than or equal to 0"),
        (["model.tiny.num_heads=3"], r"model\.tiny: hidden_size 128 is not divisible by num_heads 3"),
        (["algo"], r"not of the form key\.sub=value"),
        (["algo.group_size.low=1"], r"algo\.group_size is not a section"),
        (["inference.dtype=bf16"], r"inference\.dtype: Input should be 'float32', 'bfloat16' or 'float16'"),
    ],
)
def test_bad_values_and_unknown_keys_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIGS / "grpo_tiny.yaml", overrides)


def test_seed_keys_conflicting_with_algo_keys_are_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training: {gamma: 0.9}\nalgo: {gamma: 0.99}\n")
    with pytest.raises(ConfigError, match="training.gamma=0.9 conflicts with algo.gamma=0.99"):
        load_config(path)


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml' is not valid YAML"):
        load_config(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(listing)


def test_parse_cpu_list():
    assert parse_cpu_list(["0-3", 8]) == [0, 1, 2, 3, 8]
    assert parse_cpu_list("5,1-2") == [1, 2, 5]
    assert parse_cpu_list(None) == []
    for bad in (["3-1"], ["a"], [True], "1-"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.name=ppo", "algo.advantage=grpo"], r"algo\.name=ppo with algo\.advantage=grpo: PPO trains a critic"),
        (["algo.name=grpo", "algo.advantage=gae"], r"algo\.name=grpo with algo\.advantage=gae: grpo has no critic"),
        (["algo.name=gspo", "algo.policy_loss=ppo"], r"algo\.name=gspo with algo\.policy_loss=ppo"),
        (["algo.name=dpo", "algo.advantage=gae"], r"algo\.name=dpo with algo\.advantage=gae: DPO learns from preference"),
        (["algo.kl_kind=k1"], r"algo\.kl_kind=k1 with algo\.kl_coef=0\.001: as a loss term k1 .* zero expected gradient"),
        (["algo.kl_kind=k1", "algo.name=ppo"], r"algo\.kl_kind=k1 .* the penalty would do nothing; use k2"),
        (["inference.temperature=0"], r"inference\.temperature=0 with algo\.name=grpo: greedy decoding"),
    ],
)
def test_combinations_that_cannot_run_are_refused_at_load_naming_both_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_k1_without_a_penalty_and_greedy_dpo_are_fine():
    """k1 is refused only where it would be a loss term; DPO samples nothing, so temperature 0 is fine."""
    assert load_config(None, ["algo.kl_kind=k1", "algo.kl_coef=0"]).algo.kl_kind == "k1"
    assert load_config(None, ["algo.name=dpo", "inference.temperature=0"]).inference.temperature == 0


def test_the_algorithm_sets_its_own_defaults():
    algos = {name: load_config(None, [f"algo.name={name}"]).algo for name in ("grpo", "gspo", "ppo")}
    assert {name: (a.advantage, a.policy_loss, a.uses_critic) for name, a in algos.items()} == {
        "grpo": ("grpo", "ppo", False),
        "gspo": ("grpo", "gspo", False),
        "ppo": ("gae", "ppo", True),
    }
    assert load_config(None, ["algo.name=gspo", "algo.advantage=rloo"]).algo.advantage == "rloo"
    # DPO samples nothing and always needs the reference model (its loss compares against it)
    dpo = load_config(None, ["algo.name=dpo", "algo.kl_coef=0"]).algo
    assert (dpo.generates, dpo.uses_reference, dpo.uses_critic) == (False, True, False)
    assert (algos["grpo"].generates, load_config(None, ["algo.kl_coef=0"]).algo.uses_reference) == (True, False)

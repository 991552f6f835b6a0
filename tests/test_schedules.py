import pytest

from pipelines.algos.schedules import clip_eps, gae_lambda, group_size


def test_clip_eps_decays_five_percent_every_thousand_steps():
    assert clip_eps(0) == 0.2
    assert clip_eps(999) == 0.2
    assert clip_eps(1000) == pytest.approx(0.19)
    assert clip_eps(5000) == pytest.approx(0.2 * 0.95**5)
    assert all(clip_eps(s + 1) <= clip_eps(s) for s in range(0, 10_000, 37))
    with pytest.raises(ValueError):
        clip_eps(-1)


def test_gae_lambda_ramps_from_point_nine_to_point_nine_five():
    assert gae_lambda(0) == pytest.approx(0.9)
    assert gae_lambda(250, ramp_steps=1000) == pytest.approx(0.9125)
    assert gae_lambda(1000) == pytest.approx(0.95)
    assert gae_lambda(10**6) == pytest.approx(0.95)
    assert gae_lambda(5, ramp_steps=0) == 0.95


def test_group_size_grows_ten_percent_per_round():
    assert [group_size(r, start=32) for r in range(5)] == [32, 35, 39, 43, 47]
    assert [group_size(r, start=8) for r in range(4)] == [8, 9, 10, 11]
    assert group_size(50, start=8, maximum=16) == 16
    assert group_size(3, start=8, growth=0.0) == 8
    with pytest.raises(ValueError):
        group_size(0, start=0)


def test_group_size_at_a_step_follows_the_config():
    from pipelines.config import load_config
    from pipelines.rl.phases import group_size_at, prompts_at

    overrides = ["algo.group_growth=0.1", "algo.group_growth_every=100", "algo.group_size_max=10", "training.batch_size=128"]
    cfg = load_config(None, overrides)
    assert [group_size_at(cfg, s) for s in (0, 99, 100, 200, 5000)] == [8, 8, 9, 10, 10]
    assert [prompts_at(cfg, s) for s in (0, 100, 200)] == [16, 14, 12]
    assert group_size_at(load_config(None, []), 10**6) == 8  # no growth by default

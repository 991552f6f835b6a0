import json

from pipelines.config import MonitorConfig
from pipelines.rl.monitor import Alerts, Sinks


def _m(step, reward=0.0, **kw):
    return {"step": step, "reward_mean": reward, "grad_norm": 0.5, "kl": 0.001, **kw}


def test_threshold_alerts_follow_the_seeds():
    alerts = Alerts(MonitorConfig())
    out = alerts.check(_m(0, grad_norm=1.6, kl=0.03, reward_all_zero=True, update_success=0.0))
    assert any("grad norm 1.600 > 1.5" in a for a in out)
    assert any("KL to reference 0.0300 > 0.02" in a for a in out)
    assert any("reward model's health" in a for a in out)
    assert any("update was skipped" in a for a in out)
    assert Alerts(MonitorConfig()).check(_m(0)) == []


def test_reward_falling_alert_needs_five_consecutive_drops():
    alerts = Alerts(MonitorConfig(), reward_span=2.0)
    for step in range(10):
        assert alerts.check(_m(step, reward=0.5)) == []
    fired = [alerts.check(_m(10 + i, reward=0.2)) for i in range(5)]
    assert [bool(f) for f in fired] == [False, False, False, False, True]
    assert "5 consecutive steps" in fired[-1][0]
    assert alerts.check(_m(20, reward=0.6)) == []  # a recovery resets the streak


def test_sinks_write_jsonl_tensorboard_and_plot_and_truncate_on_resume(tmp_path):
    sinks = Sinks(tmp_path)
    for step in range(6):
        sinks.write(_m(step, reward=step / 10, alerts=[]))
    assert sinks.plot_rewards().stat().st_size > 0
    sinks.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 6
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    resumed = Sinks(tmp_path, resume_step=4)
    assert [m["step"] for m in resumed.history] == [0, 1, 2, 3]
    resumed.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]


def test_console_prints_each_kind_of_alert_at_most_once_per_ten_steps():
    alerts = Alerts(MonitorConfig(print_every=10))
    printed = [alerts.to_print(step, alerts.check(_m(step, kl=0.05))) for step in range(25)]
    assert [step for step, lines in enumerate(printed) if lines] == [0, 10, 20]
    assert alerts.to_print(25, ["grad norm 2.000 > 1.5"]) == ["grad norm 2.000 > 1.5"]  # another kind

"""Bad input, generated (hypothesis): malformed configs, dataset rows and chat request bodies each
end in an error that names the key, the file and line, or the field; never in another exception
from inside the code that read them."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from pipelines.config import ConfigError, DatasetConfig, RaypoConfig, load_config
from pipelines.data.dataset import DatasetError, load_dataset_task, row_problem
from serve.ingress import chat_messages_problem

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**9), 10**9) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of the config tree (sections walked, their fields listed)."""
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += _leaves(annotation, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


KEYS = _leaves(RaypoConfig)


@SETTINGS
@given(key=st.sampled_from(KEYS), value=JSON)
def test_any_value_for_any_key_loads_or_is_refused_naming_the_key(key, value):
    try:
        load_config(overrides=[f"{key}={json.dumps(value)}"])  # JSON is YAML
    except ConfigError as err:
        section = key.split(".")[0]
        assert key in str(err) or f"  {section}" in str(err) or f"{section}." in str(err), (key, value, str(err))


@SETTINGS
@given(
    section=st.sampled_from([k.rsplit(".", 1)[0] for k in KEYS if "." in k]), name=st.from_regex(r"[a-z_]{1,12}", fullmatch=True)
)
def test_an_unknown_key_is_named(section, name):
    if f"{section}.{name}" in KEYS or any(k.startswith(f"{section}.{name}.") for k in KEYS):
        return
    try:
        load_config(overrides=[f"{section}.{name}=1"])
    except ConfigError as err:
        assert f"{section}.{name}: unknown key" in str(err) or f"{section}.{name}" in str(err), str(err)
    else:
        raise AssertionError(f"{section}.{name} was taken")


@SETTINGS
@given(text=st.text(max_size=200))
def test_any_config_file_loads_or_is_refused_naming_the_file(text):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "preset.yaml"
        path.write_text(text)
        try:
            load_config(path)
        except ConfigError as err:
            assert str(path) in str(err) or "invalid config" in str(err), str(err)


@SETTINGS
@given(row=JSON)
def test_any_dataset_row_is_a_problem_or_refused_with_a_reason(row):
    cfg = DatasetConfig(path="x.jsonl")
    try:
        row_problem(row, cfg, lambda prompt, chat: str(prompt))
    except ValueError as err:
        assert str(err).strip(), row


@SETTINGS
@given(
    lines=st.lists(st.one_of(JSON.map(json.dumps), st.text(max_size=30).filter(lambda t: "\n" not in t)), min_size=1, max_size=6)
)
def test_a_dataset_file_with_any_bad_line_is_refused_naming_the_file_and_line(tiny_tokenizer, lines):
    good = [json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) for a in range(20)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.jsonl"
        path.write_text("\n".join([*good, *lines]) + "\n")
        try:
            load_dataset_task(DatasetConfig(path=str(path)), tiny_tokenizer)
        except DatasetError as err:
            assert f"{path}:" in str(err) or "no prompts" in str(err) or "held-out" in str(err), str(err)


@SETTINGS
@given(body=JSON | st.fixed_dictionaries({"messages": st.lists(JSON, max_size=4)}))
def test_any_chat_body_is_taken_or_refused_naming_the_field(body):
    problem = chat_messages_problem(body)
    assert problem is None or problem.startswith("messages"), problem
    if problem is None:
        assert all(isinstance(m, dict) and m.get("role") for m in body["messages"])

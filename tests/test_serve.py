"""The Serve app on a real local Ray Serve, driven by the official `openai` client, serving a
checkpoint that raypo trained."""

import json
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import ray
from pydantic import ValidationError

from serve.app import ServeArgs, build_app

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def trained_checkpoint(tiny_model, tmp_path_factory):
    from pipelines.config import load_config
    from pipelines.trainer import train

    out = tmp_path_factory.mktemp("runs")
    cfg = load_config(ROOT / "configs" / "grpo_tiny.yaml", ["training.steps=1", "task.eval_problems=20", f"output_dir={out}"])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        return train(cfg)["policy"]
    finally:
        ray.shutdown()


API_KEY = "test-key-not-secret"


@pytest.fixture(scope="module")
def server(trained_checkpoint):
    from ray import serve

    port = _free_port()
    os.environ["RAYPO_API_KEY"] = API_KEY  # read by the ingress replica, which inherits it from this process
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"checkpoint": trained_checkpoint, "max_model_len": 128}), name="raypo", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
    del os.environ["RAYPO_API_KEY"]


def _request(url, body=None, key=API_KEY, raw=None):
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_openai_client_gets_completions_and_chat_streamed_and_not(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=API_KEY)
    assert [m.id for m in client.models.list().data] == ["raypo-policy"]
    completion = client.completions.create(model="raypo-policy", prompt="12+7=", max_tokens=5, temperature=0)
    text = completion.choices[0].text
    assert text and text.strip().lstrip("-").isdigit()
    chat = client.chat.completions.create(
        model="raypo-policy", messages=[{"role": "user", "content": "12+7="}], max_tokens=5, temperature=0
    )
    assert chat.choices[0].message.content == text  # the chat template adds nothing to the prompt
    stream = client.chat.completions.create(
        model="raypo-policy", messages=[{"role": "user", "content": "12+7="}], max_tokens=5, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == text


def test_args_refuse_a_directory_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValidationError, match="no .safetensors weights"):
        ServeArgs(checkpoint=str(tmp_path))
    with pytest.raises(ValidationError, match="not a Hugging Face model directory"):
        ServeArgs(checkpoint=str(tmp_path / "missing"))


def test_serve_config_yaml_matches_serves_schema_and_the_app_args():
    import yaml
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config)
    app = schema.applications[0]
    assert app.import_path == "serve.app:build_app"
    assert set(app.args) <= set(ServeArgs.model_fields)
    assert config["http_options"]["host"] == "127.0.0.1"


def test_health_is_open_and_everything_else_needs_the_key(server):
    assert _request(f"{server}/health", key=None) == (200, {"status": "ok", "models": ["raypo-policy"]})
    for key in (None, "wrong"):
        status, body = _request(f"{server}/v1/models", key=key)
        assert status == 401 and body["error"]["type"] == "invalid_request_error"
    assert _request(f"{server}/v1/models")[0] == 200


GOOD = {"model": "raypo-policy", "prompt": "12+7=", "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize(
    "body, raw, status",
    [
        (None, b"{not json", 400),
        ({**GOOD, "model": "nope"}, None, 404),
        ({**GOOD, "prompt": "1+" * 200}, None, 400),  # longer than the 128-token context
        ({**GOOD, "max_tokens": 10**9}, None, 400),
        ({**GOOD, "max_tokens": "many"}, None, 400),
        ({**GOOD, "temperature": -1}, None, 400),
    ],
    ids=["malformed-json", "unknown-model", "prompt-too-long", "absurd-max-tokens", "wrong-type", "negative-temperature"],
)
def test_bad_requests_get_openai_style_4xx_and_the_server_keeps_answering(server, body, raw, status):
    got, error = _request(f"{server}/v1/completions", body=body, raw=raw)
    assert got == status and error["error"]["message"]
    ok, answer = _request(f"{server}/v1/completions", body=GOOD)
    assert ok == 200 and answer["choices"][0]["text"]

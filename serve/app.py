"""The Ray Serve application that exposes a trained policy over an OpenAI-compatible HTTP API.

Built on Ray's own `ray.serve.llm` (a vLLM engine per replica behind Ray's OpenAI router):
`/v1/completions`, `/v1/chat/completions` (streaming too), `/v1/models`, and `/health`; an
optional API key (serve/ingress.py). `build_app(args)`
takes typed arguments, so `serve run serve.app:build_app checkpoint=...` and `raypo serve`
build the same application.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ServeArgs(BaseModel):
    """Arguments of the raypo Serve app (also the `args:` of serve/config.yaml)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str = Field(description="a Hugging Face model directory written by raypo (safetensors weights)")
    model_id: str = Field("raypo-policy", description="the model name clients pass as `model`")
    min_replicas: int = Field(1, ge=0, description="fewest replicas (autoscaling on ongoing requests)")
    max_replicas: int = Field(1, ge=1, description="most replicas")
    target_ongoing_requests: int = Field(16, ge=1, description="autoscaling target of in-flight requests per replica")
    max_ongoing_requests: int = Field(64, ge=1, description="requests a replica takes at once; more wait in Serve's queue")
    max_model_len: int | None = Field(None, ge=16, description="context length (default: the model's)")
    cpus_per_replica: float = Field(1.0, gt=0, description="CPUs reserved for each replica's engine")
    use_gpu: bool = Field(False, description="one GPU per replica")
    gpu_memory_fraction: float = Field(0.8, gt=0, le=1, description="share of GPU memory vLLM may take")
    api_key_file: str | None = Field(None, description="file holding the API key (RAYPO_API_KEY takes precedence)")

    @field_validator("checkpoint")
    @classmethod
    def _is_safetensors_model(cls, value: str) -> str:
        path = Path(value).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(f"checkpoint {value!r} is not a Hugging Face model directory (no config.json)")
        if not list(path.glob("*.safetensors")):
            raise ValueError(f"checkpoint {value!r} has no .safetensors weights (pickled weights are never loaded)")
        return str(path.resolve())


def llm_config(args: ServeArgs):
    from ray.serve.llm import LLMConfig

    bundle = {"CPU": args.cpus_per_replica, **({"GPU": 1} if args.use_gpu else {})}
    engine_kwargs = {
        "dtype": "float32" if not args.use_gpu else "auto",
        "max_model_len": args.max_model_len,
        "enforce_eager": not args.use_gpu,
        "load_format": "safetensors",
    }
    if args.use_gpu:
        engine_kwargs["gpu_memory_utilization"] = args.gpu_memory_fraction
    env = {} if args.use_gpu else {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    return LLMConfig(
        model_loading_config={"model_id": args.model_id, "model_source": args.checkpoint},
        engine_kwargs={k: v for k, v in engine_kwargs.items() if v is not None},
        placement_group_config={"bundles": [bundle]},
        runtime_env={"env_vars": env} if env else None,
        deployment_config={
            "autoscaling_config": {
                "min_replicas": args.min_replicas,
                "max_replicas": args.max_replicas,
                "target_ongoing_requests": args.target_ongoing_requests,
            },
            "max_ongoing_requests": args.max_ongoing_requests,
        },
    )


def build_app(args: dict | ServeArgs):
    """The OpenAI-compatible Serve application for `args` (a dict from YAML, or ServeArgs)."""
    from serve.ingress import build_ingress

    args = args if isinstance(args, ServeArgs) else ServeArgs.model_validate(args)
    return build_ingress([llm_config(args)], key_file=args.api_key_file)

"""The Ray Serve application that exposes a trained policy over an OpenAI-compatible HTTP API.

Built on Ray's own `ray.serve.llm` (a vLLM engine per replica behind Ray's OpenAI router):
`/v1/completions`, `/v1/chat/completions` (streaming too), `/v1/models`, `/health` and
`/versions`; an optional API key (serve/ingress.py); blue-green promotion with automatic
rollback (serve/versions.py). `build_app(args)`
takes typed arguments, so `serve run serve.app:build_app checkpoint=...` and `raypo serve`
build the same application.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.common import ResourceFitError, check_fit, cpu_shortfall
from serve.versions import WatchConfig


class ServeArgs(BaseModel):
    """Arguments of the raypo Serve app (also the `args:` of serve/config.yaml)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str = Field(description="a Hugging Face model directory written by raypo (safetensors weights)")
    model_id: str = Field("raypo-policy", description="the model name clients pass as `model`")
    min_replicas: int = Field(1, ge=0, description="fewest replicas (autoscaling on ongoing requests)")
    max_replicas: int = Field(1, ge=1, description="most replicas")
    target_ongoing_requests: int = Field(16, ge=1, description="autoscaling target of in-flight requests per replica")
    max_ongoing_requests: int = Field(64, ge=1, description="requests a replica takes at once; more wait in Serve's queue")
    upscale_delay_s: float = Field(30.0, ge=0, description="seconds of load above target before a replica is added")
    max_model_len: int | None = Field(None, ge=16, description="context length (default: the model's)")
    cpus_per_replica: float = Field(1.0, gt=0, description="CPUs reserved for each replica's engine")
    use_gpu: bool = Field(False, description="one GPU per replica")
    gpu_memory_fraction: float = Field(0.8, gt=0, le=1, description="share of GPU memory vLLM may take")
    max_queued_requests: int = Field(
        64, ge=-1, description="requests that may wait at the ingress beyond what the engines take; more get 503 (-1: unbounded)"
    )
    max_constructor_retries: int = Field(3, ge=1, description="times Serve retries a replica whose engine fails to start")
    api_key_file: str | None = Field(None, description="file holding the API key (RAYPO_API_KEY takes precedence)")
    watch: WatchConfig = Field(default_factory=WatchConfig, description="health checks, promotion gate and automatic rollback")
    engine_ingress: bool = Field(
        False,
        description="the engine's replica answers HTTP itself (one process per request, as `vllm serve`): faster, "
        "one version, no promote/rollback (serve/engine_ingress.py)",
    )

    @model_validator(mode="after")
    def _engine_ingress_keeps_a_replica(self):
        if self.engine_ingress and self.min_replicas < 1:
            raise ValueError(
                "engine_ingress needs min_replicas >= 1: the engine replica is what listens for requests, "
                "so with none running no request could wake one"
            )
        return self

    @field_validator("checkpoint")
    @classmethod
    def _is_safetensors_model(cls, value: str) -> str:
        path = Path(value).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(f"checkpoint {value!r} is not a Hugging Face model directory (no config.json)")
        if not list(path.glob("*.safetensors")):
            raise ValueError(f"checkpoint {value!r} has no .safetensors weights (pickled weights are never loaded)")
        return str(path.resolve())


INGRESS_CPUS = 0.1  # the ingress only routes; the Versions deployment reserves none
DIRECT_INGRESS_PORTS = 16  # the front ingress binds the first; each promoted version's app takes one above it


def direct_ingress_env(port: int) -> dict[str, str]:
    """Ray Serve settings for a Ray that raypo starts itself to serve on `port`.

    Ray's throughput-optimized mode (gRPC between replicas, the garbage collector frozen after
    start-up) with direct ingress: the front ingress replica runs the HTTP server on `port`
    itself, so a request skips Serve's proxy actor, a whole process hop on the way in and out
    (bench/serve_load.py, README "Serving the trained policy").

    Ray reads these when each of its processes starts: they take effect only in a Ray started
    after they are set (`raypo serve` when it starts its own Ray). Every application's ingress
    replica gets a port of [port, port + DIRECT_INGRESS_PORTS); a promoted version's LLMServer is
    its application's ingress, so it binds one above `port` (it has no HTTP routes: it answers
    500). No quarantine, so a front ingress replica that died is replaced on `port`. One that is
    replaced while still draining (a failed health check) is not: its successor gets the next
    port, and `raypo serve` says so. `raypo serve --proxy` keeps Ray's default path (Serve's
    proxy actor on `port`).

    >>> env = direct_ingress_env(8000)
    >>> env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]
    ('8000', '8016')
    """
    return {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",  # whatever the caller's environment says
        "RAY_SERVE_LOG_TO_STDERR": "1",  # replicas' errors still reach the console
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + DIRECT_INGRESS_PORTS),
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        # Ray drains a stopping ingress replica for at least 30 s so that an external load balancer
        # notices; clients here connect to the port itself, and Ctrl-C should not wait that long.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
    }


def start_http(host: str, port: int, direct: bool) -> None:
    """Start Serve's HTTP side on `host:port`. `direct`: the Ray was started with
    `direct_ingress_env(port)`, so the front ingress replica will bind `port` itself and Serve's
    proxy (which Serve still starts) gets a free port of its own. Raises OSError naming the port
    when something else already listens there (direct ingress would otherwise move to the next
    port of its range without a word), or when the range above it passes 65535."""
    import socket

    from ray import serve

    proxy_port = port
    if direct:
        if port + DIRECT_INGRESS_PORTS > 65536:
            raise OSError(f"cannot serve on port {port}: promoted versions need the {DIRECT_INGRESS_PORTS - 1} ports above it")
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's: TIME_WAIT is no conflict
            try:
                probe.bind(address)
            except OSError as err:
                raise OSError(err.errno, f"cannot serve on {host}:{port}: {err.strerror} (is another server there?)") from None
        with socket.socket(family, kind) as free:
            free.bind((address[0], 0, *address[2:]))
            proxy_port = free.getsockname()[1]
    serve.start(http_options={"host": host, "port": proxy_port})


def listens(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether something accepts connections on `host:port`."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def cpu_plan(args: ServeArgs) -> dict[str, float]:
    """CPUs the app reserves at its smallest (`min_replicas` engines), by part. An engine
    replica's actor lives in its own placement bundle and reserves nothing beside it."""
    engines = {
        f"engine replicas ({max(1, args.min_replicas)} x {args.cpus_per_replica:g})": max(1, args.min_replicas)
        * args.cpus_per_replica
    }
    return engines if args.engine_ingress else {**engines, "ingress": INGRESS_CPUS}


def check_fits(args: ServeArgs, cluster: dict[str, float]) -> None:
    """Raise ResourceFitError at once when the app cannot be placed on a cluster with `cluster`
    resources (`ray.cluster_resources()`): Serve would otherwise wait for it forever."""
    if short := cpu_shortfall(cpu_plan(args), cluster):
        raise ResourceFitError(f"the app {short}; lower --cpus-per-replica or --min-replicas, or serve on a bigger cluster")
    if args.use_gpu and cluster.get("GPU", 0.0) < max(1, args.min_replicas):
        raise ResourceFitError(
            f"the app needs {max(1, args.min_replicas)} GPUs (one per engine replica) but the cluster has none"
        )


def ensure_fits(args: ServeArgs, cluster: dict[str, float], local_ray: bool) -> None:
    """`check_fits`, failing on a local Ray and warning on a joined cluster (actors.common.check_fit)."""
    check_fit(lambda: check_fits(args, cluster), local_ray=local_ray)


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
    if args.engine_ingress and args.api_key_file:
        from serve.engine_ingress import KEY_FILE_ENV

        env[KEY_FILE_ENV] = str(Path(args.api_key_file).expanduser().resolve())
    return LLMConfig(
        model_loading_config={"model_id": args.model_id, "model_source": args.checkpoint},
        # Ray's copy of the engine's metrics costs its metrics agent a core's share per request on a
        # small machine; with engine_ingress vLLM's own /metrics route serves them instead.
        log_engine_metrics=not args.engine_ingress,
        engine_kwargs={k: v for k, v in engine_kwargs.items() if v is not None},
        placement_group_config={"bundles": [bundle]},
        runtime_env={"env_vars": env} if env else None,
        deployment_config={
            "autoscaling_config": {
                "min_replicas": args.min_replicas,
                "max_replicas": args.max_replicas,
                "target_ongoing_requests": args.target_ongoing_requests,
                "upscale_delay_s": args.upscale_delay_s,
            },
            "max_ongoing_requests": args.max_ongoing_requests,
            "max_constructor_retry_count": args.max_constructor_retries,
            # the replica actor shares its engine's placement bundle instead of adding a CPU of its own
            "ray_actor_options": {"num_cpus": 0},
        },
    )


def version_app(args: ServeArgs):
    """One policy version: an LLMServer deployment (its own application when promoted)."""
    from ray.llm._internal.serve.core.server.builder import build_llm_deployment

    from serve.engine import OneProcessLLMServer

    return build_llm_deployment(llm_config(args), deployment_cls=OneProcessLLMServer, name_prefix="LLMServer:")


def build_app(args: dict | ServeArgs):
    """The front application for `args` (a dict from YAML, or ServeArgs): the OpenAI ingress,
    the version table, and the first version's LLMServer (with `engine_ingress`: `engine_ingress_app`).

    The ingress takes at most what the engines can (`max_replicas * max_ongoing_requests`)
    and queues `max_queued_requests` more; beyond that Serve answers 503 at once.
    """
    from ray import serve
    from ray.llm._internal.common.dict_utils import maybe_apply_llm_deployment_config_defaults
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress

    from serve.ingress import ingress_deployment
    from serve.versions import Versions

    args = args if isinstance(args, ServeArgs) else ServeArgs.model_validate(args)
    if args.engine_ingress:
        return engine_ingress_app(args)
    config = llm_config(args)
    options = maybe_apply_llm_deployment_config_defaults(OpenAiIngress.get_deployment_options([config]), None)
    # The ingress never scales to zero (Ray's default when the engines may): under direct ingress
    # it is what listens on the port, and with none there no request could wake it. It costs 0.1 CPU.
    autoscaling = options.setdefault("autoscaling_config", {})
    autoscaling["min_replicas"] = max(1, autoscaling.get("min_replicas", 1))
    options["max_ongoing_requests"] = args.max_replicas * args.max_ongoing_requests
    options["max_queued_requests"] = args.max_queued_requests
    options["ray_actor_options"] = {**options.get("ray_actor_options", {}), "num_cpus": INGRESS_CPUS}
    first = version_app(args)
    versions = serve.deployment(Versions, name="Versions", num_replicas=1, ray_actor_options={"num_cpus": 0}).bind(
        args=args.model_dump(mode="json"), first_deployment=first._bound_deployment.name
    )
    return (
        ingress_deployment(args.api_key_file)
        .options(**options)
        .bind(
            llm_deployments={args.model_id: first},
            model_cards={args.model_id: to_model_metadata(args.model_id, config)},
            lora_paths={},
            versions=versions,
        )
    )


def engine_ingress_app(args: ServeArgs):
    """The app of `engine_ingress`: one LLMServer deployment that is its own HTTP ingress
    (serve/engine_ingress.py); it queues `max_queued_requests` beyond what its replicas take."""
    from ray import serve
    from ray.llm._internal.serve.core.server.builder import build_llm_deployment

    from serve.engine_ingress import EngineIngress

    return build_llm_deployment(
        llm_config(args),
        deployment_cls=serve.ingress()(EngineIngress),
        override_serve_options={"max_queued_requests": args.max_queued_requests},
    )

"""The `raypo` command line: one sub-command per job, each a thin call into pipelines.

Each command imports what it runs inside its own function: torch, transformers, Ray and vLLM
take seconds to import, and `raypo --help` or `raypo show-config` need none of them.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import yaml
from pydantic import ValidationError

from pipelines.config import ConfigError, RaypoConfig, load_config
from pipelines.data.dataset import DatasetError

SERVE_SHUTDOWN_S = 30  # how long Ctrl-C waits for Serve to delete its apps before Ray is stopped


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML config file (presets in configs/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set algo.clip_eps=0.1 (repeatable)",
    )


# `raypo train` with no --config trains this preset (GRPO on the embedded tiny model).
DEFAULT_TRAIN_PRESET = Path(__file__).resolve().parent.parent / "configs" / "grpo_tiny.yaml"
FAKE_CLUSTER = Path(__file__).resolve().parent.parent / "configs" / "fake_cluster.yaml"


def _load(args: argparse.Namespace) -> RaypoConfig:
    path = args.config
    if path is None and args.command == "train" and DEFAULT_TRAIN_PRESET.is_file():
        path = DEFAULT_TRAIN_PRESET
    return load_config(path, args.overrides)


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from pipelines.models.tiny import make_tiny

    cfg = _load(args)
    path, manifest = make_tiny(cfg.model.tiny, force=args.force)
    print(f"held-out greedy accuracy: {manifest['heldout_accuracy']:.1%} ({manifest['heldout_problems']} problems)")
    print(path)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from pipelines.models.resolve import resolve_model_path
    from pipelines.rl.evaluation import evaluate_model

    cfg = _load(args)
    path = Path(args.model) if args.model else resolve_model_path(cfg)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--model {str(path)!r} is not a Hugging Face model directory (no config.json)")
    out = Path(args.out) if args.out else Path(cfg.output_dir) / cfg.name / "eval.jsonl"
    summary = evaluate_model(cfg, path, out)
    print(json.dumps({**summary, "per_sample": str(out)}, indent=2))
    return 0


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from pipelines.models.gguf import import_gguf

    out = import_gguf(args.file, args.out_dir)
    print(f"imported {args.file} -> {out} (use it as model.path)")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from pipelines.rl.trainer import train

    cfg = _load(args)
    summary = train(cfg, address=args.address, resume=args.resume)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from pipelines.rl.tune import print_summary, sweep

    if args.config is None:
        raise SystemExit("raypo tune needs a sweep file: raypo tune -c configs/tune_grpo_tiny.yaml")
    result = sweep(args.config, args.overrides, resume=args.resume, address=args.address)
    print_summary(result)
    return 0


def cmd_train_rm(args: argparse.Namespace) -> int:
    from pipelines.rl.reward_model import train_reward_model

    summary = train_reward_model(_load(args), address=args.address)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a checkpoint over the OpenAI API until interrupted, or operate on a running app."""
    from pipelines.cluster import connect_ray

    if args.action != "start":
        from serve import ops

        address = args.address or os.environ.get("RAY_ADDRESS") or _served_ray(args.app)
        try:
            connect_ray(address, join_only=True, log_to_driver=False)
        except ConnectionError as err:
            print(f"raypo serve {args.action}: no running Ray cluster to talk to ({err})", file=sys.stderr)
            return 1
        try:
            if args.action == "promote":
                if not args.target:
                    raise SystemExit("raypo serve promote needs a checkpoint: raypo serve promote runs/<name>/final")
                target = str(_local_checkpoint(args.target))
                table = ops.promote(target, front_app=args.app, ready_timeout_s=args.ready_timeout)
            else:
                table = ops.rollback(args.app) if args.action == "rollback" else ops.status(args.app)
        except ops.ServeOpError as err:
            print(f"raypo serve {args.action}: {err}", file=sys.stderr)
            return 1
        print(ops.format_status(table))
        return 0
    return _serve_forever(args)


def _local_checkpoint(location: str) -> Path:
    """A checkpoint to serve: a local directory, or a run's storage URI (`<storage_path>/<name>/final`)
    downloaded once into the raypo cache on this machine."""
    from pipelines.data.storage import is_uri, local_copy
    from pipelines.models.tiny import cache_root

    if is_uri(location):
        print(f"fetching {location} ...", flush=True)
    return local_copy(location, cache_root())


def _serve_address_file(app: str) -> Path:
    """Where `raypo serve` leaves the GCS address of the Ray it started for the front app `app`."""
    from pipelines.models.tiny import cache_root

    return cache_root() / f"serve-{app}.address"


def _served_ray(app: str) -> str | None:
    """The Ray that a running `raypo serve` started for `app`, if its address file is there and
    its GCS answers. That Ray uses Ray's token auth, so this process becomes its client
    (RAY_AUTH_MODE=token, set before Ray is imported here)."""
    from pipelines.cluster import AUTH_MODE, gcs_answers

    path = _serve_address_file(app)
    address = path.read_text().strip() if path.is_file() else None
    if not address or not gcs_answers(address):
        return None
    if "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", AUTH_MODE)
    return address


def _serve_forever(args: argparse.Namespace) -> int:
    """Start the app and serve until SIGINT/SIGTERM; then take it down and exit 130 (0 on SIGTERM)."""
    import ray

    from pipelines.cluster import connect_ray
    from serve.app import ServeArgs, build_app, direct_ingress_env, ensure_fits, start_http

    if not args.checkpoint:
        raise SystemExit("raypo serve needs --checkpoint (a model directory, e.g. runs/<name>/final)")
    serve_args = ServeArgs(
        checkpoint=str(_local_checkpoint(args.checkpoint)),
        model_id=args.model_id,
        max_model_len=args.max_model_len,
        min_replicas=args.min_replicas,
        max_replicas=max(args.max_replicas, args.min_replicas),
        cpus_per_replica=args.cpus_per_replica,
        engine_ingress=args.engine_ingress,
    )
    stopped = {"code": 130}

    def on_stop(signum, frame):
        stopped["code"] = 0 if signum == signal.SIGTERM else 130
        raise KeyboardInterrupt

    def own_the_stop_signals():  # set again once Serve is up, in case a library replaced them
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGTERM, on_stop)

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack, for a hang
    own_the_stop_signals()
    address_file, wrote_address = _serve_address_file(args.app), False
    try:
        try:
            local_ray = connect_ray(
                args.address, include_dashboard=False, local_env=None if args.proxy else direct_ingress_env(args.port)
            )
        except ConnectionError as err:
            print(f"raypo serve: error: {err}", file=sys.stderr)
            return 1
        if serve_args.engine_ingress and local_ray and not args.proxy and serve_args.max_replicas > 1:
            print(
                "raypo serve: error: --engine-ingress serves from the engine replica on --port itself, so one replica "
                f"only (--max-replicas {serve_args.max_replicas}); add --proxy to spread requests over replicas",
                file=sys.stderr,
            )
            ray.shutdown()
            return 2
        try:
            ensure_fits(serve_args, ray.cluster_resources(), local_ray=local_ray)
        except RuntimeError as err:  # ResourceFitError: the app cannot fit this local Ray
            print(f"raypo serve: error: {err}", file=sys.stderr)
            ray.shutdown()
            return 2
        from ray import serve  # after connect_ray: its Serve settings are read when ray.serve is imported

        print(f"starting the engine for {serve_args.checkpoint} (about a minute on CPU)...", flush=True)
        try:
            start_http(args.host, args.port, direct=local_ray and not args.proxy)
        except OSError as err:
            print(f"raypo serve: error: {err}", file=sys.stderr)
            ray.shutdown()
            return 2
        serve.run(build_app(serve_args), name=args.app, route_prefix="/")
        if local_ray:  # for `raypo serve promote/rollback/status`, which find no `ray start` address file
            address_file.parent.mkdir(parents=True, exist_ok=True)
            address_file.write_text(ray.get_runtime_context().gcs_address)
            wrote_address = True
        print(f"serving {serve_args.checkpoint} as {serve_args.model_id!r} at http://{args.host}:{args.port}/v1", flush=True)
        print("press Ctrl-C to stop", flush=True)
        own_the_stop_signals()
        _watch_the_port(args.host, args.port, direct=local_ray and not args.proxy)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        print("stopping: shutting down Serve and Ray...", flush=True)
        if wrote_address:
            address_file.unlink(missing_ok=True)
        _shutdown_serve()
        print("stopped", flush=True)
        return stopped["code"]
    return 0


PORT_CHECK_S = 10.0


def _watch_the_port(host: str, port: int, direct: bool) -> None:
    """Sleep until interrupted. Under direct ingress, also check every PORT_CHECK_S that the
    port still accepts connections, and say on stderr when it stops and when it is back: an
    ingress replica that Serve replaces while the old one still drains gets the next port of its
    range instead (serve/app.py:direct_ingress_env)."""
    from serve.app import DIRECT_INGRESS_PORTS, listens

    if not direct:
        while True:
            time.sleep(3600)
    up = True
    while True:
        time.sleep(PORT_CHECK_S)
        if listens(host, port) != up:
            up = not up
            if up:
                print(f"raypo serve: {host}:{port} answers again", file=sys.stderr, flush=True)
            else:
                others = [p for p in range(port + 1, port + DIRECT_INGRESS_PORTS) if listens(host, p, 0.2)]
                print(
                    f"raypo serve: warning: nothing accepts connections on {host}:{port} now (the ingress replica is "
                    f"restarting, or Serve gave its replacement another port; listening above it: {others or 'none'}); "
                    "restart with --proxy to keep the port through replica restarts",
                    file=sys.stderr,
                    flush=True,
                )


def _shutdown_serve() -> None:
    """Delete the apps and stop the Ray this process started (a joined cluster stays up)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return

    def delete_apps():
        try:
            serve.shutdown()
        except Exception as err:  # the processes may already be going down with the signal
            print(f"(serve shutdown: {type(err).__name__}: {err})", file=sys.stderr)

    # Ctrl-C in a terminal reaches Ray's own processes too; a controller already gone must not
    # keep Serve's shutdown (and so the terminal) waiting: stop Ray after SERVE_SHUTDOWN_S anyway.
    deleting = threading.Thread(target=delete_apps, daemon=True)
    deleting.start()
    deleting.join(SERVE_SHUTDOWN_S)
    if deleting.is_alive():
        print(f"(Serve did not shut down within {SERVE_SHUTDOWN_S} s; stopping Ray)", file=sys.stderr)
    ray.shutdown()


def cmd_cluster(args: argparse.Namespace) -> int:
    """A multi-node Ray cluster on this machine with cluster.yaml's node types (Ray's fake provider)."""
    from pipelines import cluster

    try:
        if args.action == "up":
            print(f"starting the head and the worker nodes of {args.config} (about a minute)...", flush=True)
            state = cluster.up(args.config, wait_s=args.wait)
            print(cluster.format_nodes(state["nodes"]))
            print(f"\nup: GCS {state['gcs_address']}, dashboard {state['dashboard']}. Submit a run with")
            print(f"  RAY_AUTH_MODE=token ray job submit --address {state['dashboard']} --working-dir . -- raypo train")
            print("and stop the cluster with `raypo cluster down`.")
        elif args.action == "down":
            print(f"stopped {cluster.down()} processes of the cluster under {cluster.state_dir()}")
        else:
            state = cluster.status()
            if state is None:
                print(f"no raypo cluster is running from {cluster.state_dir()} (`raypo cluster up` starts one)")
                return 1
            print(f"GCS {state['gcs_address']}, dashboard {state['dashboard']}, from {state['config']}")
            print(cluster.format_nodes(state["nodes"]))
    except cluster.ClusterError as err:
        print(f"raypo cluster {args.action}: {err}", file=sys.stderr)
        return 1
    return 0


def cmd_show_config(args: argparse.Namespace) -> int:
    print(yaml.safe_dump(_load(args).model_dump(mode="json"), sort_keys=False), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raypo", description="RL post-training for language models on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="build and warm-start the embedded tiny model (cached)")
    _add_config_args(p)
    p.add_argument("--force", action="store_true", help="rebuild even when a cached model exists")
    p.set_defaults(func=cmd_make_tiny)

    p = sub.add_parser("train", help="RL training (GRPO on the embedded tiny model by default)")
    _add_config_args(p)
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray started here)")
    p.add_argument("--resume", action="store_true", help="continue runs/<name> from its latest checkpoint")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "tune",
        help="a Ray Tune sweep over config keys (Optuna TPE + ASHA); writes a results table and the best preset",
        description="raypo tune -c configs/tune_grpo_tiny.yaml runs the sweep the file describes; --resume continues "
        "an interrupted one without re-running finished trials.",
    )
    p.add_argument("--config", "-c", help="the sweep file (configs/tune_grpo_tiny.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a sweep-file key")
    p.add_argument("--resume", action="store_true", help="continue the interrupted sweep of this file (Tune's restore)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray started here)")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser(
        "train-rm", help="train a Bradley-Terry reward model on preference pairs (configs/rm_tiny.yaml; use it as model:DIR)"
    )
    _add_config_args(p)
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray started here)")
    p.set_defaults(func=cmd_train_rm)

    p = sub.add_parser(
        "eval", help="held-out evaluation: mean reward per reward function, greedy pass rate, pass@k, per-sample JSONL"
    )
    _add_config_args(p)
    p.add_argument("--model", help="model directory (default: the configured model)")
    p.add_argument("--out", help="per-sample JSON Lines (default: <output_dir>/<name>/eval.jsonl)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("import-gguf", help="write a GGUF model as a Hugging Face directory (float32 safetensors + tokenizer)")
    p.add_argument("file", help="the .gguf file")
    p.add_argument("out_dir", help="an empty or new directory")
    p.set_defaults(func=cmd_import_gguf)

    p = sub.add_parser(
        "serve",
        help="serve a checkpoint over an OpenAI-compatible HTTP API (Ray Serve); promote, rollback, status",
        description="raypo serve --checkpoint DIR starts the app; `raypo serve promote DIR` brings DIR up beside the "
        "live version and switches traffic after health checks; `raypo serve rollback`; `raypo serve status`.",
    )
    p.add_argument("action", nargs="?", default="start", choices=["start", "promote", "rollback", "status"])
    p.add_argument("target", nargs="?", help="the checkpoint to promote")
    p.add_argument("--checkpoint", help="a Hugging Face model directory, e.g. runs/<name>/final")
    p.add_argument("--app", default="raypo", help="the Serve application name of the front app")
    p.add_argument("--min-replicas", type=int, default=1, help="fewest engine replicas (autoscaling)")
    p.add_argument("--max-replicas", type=int, default=1, help="most engine replicas (autoscaling on ongoing requests)")
    p.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs each engine replica reserves")
    p.add_argument("--ready-timeout", type=float, default=600, help="seconds a promoted version may take to come up")
    p.add_argument("--model-id", default="raypo-policy", help="the model name clients pass")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--proxy",
        action="store_true",
        help="route requests through Serve's proxy actor (Ray's default) instead of the ingress replica listening on "
        "--port itself (direct ingress, the default on a Ray that raypo serve starts)",
    )
    p.add_argument(
        "--engine-ingress",
        action="store_true",
        help="the engine replica answers HTTP itself (vLLM's OpenAI server plus raypo's key check and /health): "
        "faster, but one version, so no promote/rollback",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "cluster",
        help="start, inspect or stop a multi-node Ray cluster on this machine (cluster.yaml's node types)",
        description="raypo cluster up starts Ray's fake multi-node provider with the node types of the cluster file "
        "(a head, learner and rollout nodes); down stops every process it started, by pid.",
    )
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--config", "-c", default=str(FAKE_CLUSTER), help="the cluster file (node types and their resources)")
    p.add_argument("--wait", type=float, default=180, help="seconds to wait for the worker nodes to join")
    p.set_defaults(func=cmd_cluster)

    p = sub.add_parser("show-config", help="print the resolved config as YAML (validates it)")
    _add_config_args(p)
    p.set_defaults(func=cmd_show_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DatasetError, OSError, ValidationError) as err:  # OSError: paths and storage
        print(f"raypo {args.command}: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # TrainingError and friends: the message names the cause
        print(f"raypo {args.command}: failed: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

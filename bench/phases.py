"""Per-phase time per step and tokens/s of the tiny GRPO and PPO configs, side by side, and how
close the learner comes to this machine's matmul speed.

    .venv/bin/python bench/phases.py [--steps 8] [--config examples/smollm2/grpo.yaml [--set K=V ...] [--vs K=V ...]]

Runs both configs on one local Ray (real vLLM rollouts, DeepSpeed learner), and GRPO once
more with the weights broadcast from learner rank 0 (gloo here, NCCL on GPUs) instead of
passed through the object store (`--config` adds a run of that file, `--vs` another run of it
with some keys changed, e.g. `--vs inference.dtype=bfloat16`); skips the first step
(engine warm-up), and prints a table of the mean seconds per step of each phase, its share of
the step, and the generation throughput. Compare ratios, not absolute times: the machine is
shared and noisy.

Then the bytes each step moves between roles: the experience the buffer holds (the rollout
batch and its targets, put into the object store once), what the learner ranks fetch of it
(each its own rows of each minibatch, once however many passes), and the weights each sync
delivers to the engines; with the learners' fetch time and the sync time as shares of the step
(a step with an evaluation beside it also waits in the sync for the evaluation's engine calls),
and rank 0's own update time in its actor (the learn phase less the driver's and Ray's share).

Then, per run, the learner's achieved FLOP/s: the FLOPs the policy loss needs (forward and
backward, 6 x the decoder's parameters x the real tokens, each distinct prompt counted once
(a group's samples share it), 6 x hidden x vocab for the LM head at response positions only, and
causal attention, 6 x layers x hidden x the keys each token attends to; padding, repeated prompts
and logits nobody reads do not count) over the learn phase's seconds,
beside the float32 GEMM FLOP/s this machine reaches on the model's own MLP shape with the
learner's threads, measured in the same run, with each of torch's two float32 GEMMs: `torch.mm`
(MKL's sgemm, what `nn.Linear` calls) and oneDNN (what raypo's learners call for the layers of at
least `onednn.MIN_WEIGHT` weights on processors other than Intel's, or on any with
`RAYPO_ONEDNN=1`: actors/core/onednn.py). The ratio is taken against the faster
of the two: how close the learner is to the machine's limit. Beside it, the FLOP/s of an update's own matmuls, each made alone at
its shape as the learner makes it (every linear layer's forward, input gradient and weight
gradient over a minibatch's packed tokens, the LM head's over its response tokens): what a
learner that did nothing but its matmuls would reach, and the learner's share of that.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

PHASES = ("generate", "reward", "reference", "value", "learn", "sync")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's packages, also in the Ray workers (they take the driver's path)


RUNS = {  # column -> (preset, extra overrides)
    "grpo": ("grpo_tiny.yaml", []),
    "ppo": ("ppo_tiny.yaml", []),
    "grpo/broadcast": ("grpo_tiny.yaml", ["resource.weight_sync=broadcast", "name=grpo_broadcast"]),
}


def run(preset: str | Path, steps: int, out_dir: str, overrides: list[str]) -> tuple[list[dict], object]:
    """Steps 1.. of a `preset` run (a file name in configs/, or a path), and its config."""
    from pipelines.config import load_config
    from pipelines.rl.trainer import train

    cfg = load_config(
        ROOT / "configs" / preset if isinstance(preset, str) else preset,
        [f"training.steps={steps}", "training.save_every=0", "task.eval_problems=50", f"output_dir={out_dir}", *overrides],
    )
    train(cfg)
    lines = (Path(out_dir) / cfg.name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines][1:], cfg  # step 0 includes engine warm-up


class ModelShape:
    """What the FLOP count needs of a model directory's architecture (read once, weights never loaded)."""

    def __init__(self, model_dir: Path):
        import torch  # heavy imports inside functions: `--help` stays quick
        from torch import nn
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):  # shapes only, no weights
            model = AutoModelForCausalLM.from_config(config)
        self.head = model.get_output_embeddings().weight.numel()
        self.body = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
        self.body -= 0 if config.tie_word_embeddings else self.head
        self.hidden, self.layers = config.hidden_size, config.num_hidden_layers
        self.inner = getattr(config, "intermediate_size", 4 * config.hidden_size)
        # the linear layers' (in, out) shapes and how many of each; the LM head apart: it runs at response positions only
        output = model.get_output_embeddings()
        linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not output]
        self.linears = Counter((m.in_features, m.out_features) for m in linears)
        self.head_shape = (output.in_features, output.out_features)

    def needed_flops(self, row: dict, epochs: int) -> float:
        """FLOPs a step's policy update needs (see the module docstring), from the step's metrics."""
        prompts, responses = row["prompt_tokens_distinct"], row["response_tokens"]
        length = (row["prompt_tokens"] + responses) / row["samples"]  # mean sequence length
        prompt_length = row["prompt_tokens"] / row["samples"]
        # causal attention: each prompt token over its prompt, each response token over its whole sequence
        attention = 6 * self.layers * self.hidden * (prompts * prompt_length / 2 + responses * length)
        return epochs * (6 * self.body * (prompts + responses) + 6 * self.head * responses + attention)


def gemm_flops(hidden: int, inner: int, rows: int, seconds: float = 2.0) -> dict[str, float]:
    """float32 FLOP/s of `[rows, hidden] x [hidden, inner]` matmuls, the best of repeated timings,
    by `torch.mm` (MKL) and by oneDNN (when this torch has it)."""
    import torch  # here, like the other heavy imports of this bench: `--help` stays quick

    from actors.core import onednn

    a, b = torch.randn(rows, hidden), torch.randn(hidden, inner)
    weight = b.t().contiguous()  # [inner, hidden], as an nn.Linear holds it
    products = {"torch.mm": lambda: torch.mm(a, b)}
    if onednn.has_linear_op():  # measured even with RAYPO_ONEDNN=0: it is the machine's limit
        products["oneDNN"] = lambda: onednn.matmul_t(a, weight)
    return {name: 2 * rows * hidden * inner / fastest(product, seconds) for name, product in products.items()}


def fastest(product, seconds: float, at_least: int = 1) -> float:
    """The shortest of repeated timings of `product()`, repeated for `seconds` and `at_least` times."""
    times, started = [], time.perf_counter()
    while len(times) < at_least or time.perf_counter() - started < seconds:
        t0 = time.perf_counter()
        product()
        times.append(time.perf_counter() - t0)
    return min(times)


def update_gemm_flops(shape: ModelShape, rows: int, head_rows: int, seconds: float = 0.3) -> float:
    """FLOP/s of one update's matmuls at the model's own shapes, made as the learner's linear layers
    make them (oneDNN for the layers `use_onednn` switches, else torch's BLAS), without autograd around
    them: each linear layer's forward `x W^T`, input gradient `dy W` and weight gradient `dy^T x`
    over `rows` tokens, the LM head's over `head_rows`; each product the best of its repeated
    timings (for `seconds`, at least 3 after a first that builds oneDNN's kernel), summed over the
    layers. What a learner doing nothing but its matmuls would reach."""
    import torch  # here, like the other heavy imports of this bench: `--help` stays quick

    from actors.core import onednn

    def best(product) -> float:
        product()  # the first call builds oneDNN's kernel for the shape
        return fastest(product, seconds, at_least=3)

    in_onednn = (  # as `_Linear` multiplies
        lambda x, w, dy: onednn.matmul_t(x, w),
        lambda x, w, dy: onednn.matmul_t(dy, w.t()),
        lambda x, w, dy: onednn.weight_grad(dy, x),
    )
    in_torch = (lambda x, w, dy: x.mm(w.t()), lambda x, w, dy: dy.mm(w), lambda x, w, dy: dy.t().mm(x))  # as `nn.Linear` on CPU
    flops = total = 0.0
    layers = [(k, n, count, rows) for (k, n), count in shape.linears.items()] + [(*shape.head_shape, 1, head_rows)]
    for k, n, count, m in layers:
        x, w, dy = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
        products = in_onednn if onednn.switches(k, n) else in_torch  # as `use_onednn` switches
        flops += count * 6 * m * k * n
        total += count * sum(best(functools.partial(p, x, w, dy)) for p in products)
    return flops / total


def machine_gemm_flops(shape: ModelShape, rows: int, update_rows: tuple[int, int], threads: int) -> dict[str, float]:
    """`gemm_flops` of the model's MLP shape over `rows`, and `update_gemm_flops` over `update_rows`
    (tokens, response tokens), in a Ray task with the learner's threads (and as many CPUs)."""
    import ray  # heavy imports inside functions: `--help` stays quick

    from actors.common import limit_threads

    @ray.remote(num_cpus=threads)
    def measure() -> dict[str, float]:
        limit_threads(threads)
        return gemm_flops(shape.hidden, shape.inner, rows) | {"update": update_gemm_flops(shape, *update_rows)}

    return ray.get(measure.remote())


def mean(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows) / max(1, len(rows))


def learner_speed(rows: list[dict], cfg, out_dir: str) -> dict[str, float]:
    """The learners' achieved FLOP/s (what the loss needs over the learn phase's seconds, all ranks
    together) and the GEMM FLOP/s of as many learners' CPUs at the model's MLP shape (Ray must be
    up). For PPO the learn phase also holds the critic's update, which is not counted."""
    shape = ModelShape(Path(out_dir) / cfg.name / "final")  # the trained policy: the model's config and shapes
    achieved = sum(shape.needed_flops(r, cfg.training.epochs) for r in rows) / sum(r["time_learn"] for r in rows)
    tokens = mean(rows, "prompt_tokens") + mean(rows, "response_tokens")
    # against the most threads the learner had (sampling ahead it widens once the engine is idle: actors/learner.py:Widening)
    threads = math.ceil(max(r["learner_threads"] for r in rows))
    per_minibatch = cfg.training.minibatch_size / mean(rows, "samples") / cfg.resource.num_learners  # of a step, per learner
    gemm_rows = max(1, round(tokens * per_minibatch))
    # a minibatch's rows in the learner's matmuls: its distinct prompts' tokens and its response tokens (packed)
    packed = mean(rows, "prompt_tokens_distinct") + mean(rows, "response_tokens")
    update_rows = (max(1, round(packed * per_minibatch)), max(1, round(mean(rows, "response_tokens") * per_minibatch)))
    per_learner = machine_gemm_flops(shape, gemm_rows, update_rows, threads)
    gemms = {name: flops * cfg.resource.num_learners for name, flops in per_learner.items()}
    update = gemms.pop("update")
    named = {f"gemm {name}": f for name, f in gemms.items()}
    return {"achieved": achieved, "gemm": max(gemms.values()), "update": update, **named}


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--config", help="also run this config file (e.g. examples/smollm2/grpo.yaml)")
    parser.add_argument("--runs", nargs="*", choices=sorted(RUNS), default=list(RUNS), help="which built-in runs")
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="KEY=VALUE",
        help="overrides for the --config run (training.minibatch_size=32: one optimizer step per batch, as bench/compare_trl.py)",
    )  # fmt: skip
    parser.add_argument(
        "--vs", nargs="+", default=[], metavar="KEY=VALUE",
        help="run the --config file again with these overrides on top, in a column beside it (inference.dtype=bfloat16)",
    )  # fmt: skip
    args = parser.parse_args()
    runs = {name: RUNS[name] for name in args.runs}
    if args.config:
        column = Path(args.config).parent.name + "/" + Path(args.config).stem
        runs[column] = (Path(args.config), args.set)
        if args.vs:
            label = " ".join(key.rpartition(".")[2] + "=" + value for key, _, value in (o.partition("=") for o in args.vs))
            runs[label if label not in runs else f"vs {label}"] = (Path(args.config), [*args.set, *args.vs, "name=vs"])
    elif args.set or args.vs:
        parser.error("--set and --vs apply to the --config run: name one")
    ray.init(include_dashboard=False, log_to_driver=False)  # sized from this machine
    results, speed = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for column, (preset, overrides) in runs.items():
            results[column], cfg = run(preset, args.steps, tmp, overrides)
            speed[column] = learner_speed(results[column], cfg, tmp)
    ray.shutdown()

    print(f"\nper-phase seconds per step (mean of steps 1..{args.steps - 1}), share of the step in brackets")
    print("(reward, reference and value run at once, each timed to its own end: their shares overlap)")
    print(f"{'phase':<12}" + "".join(f"{name:>22}" for name in results))
    for phase in PHASES:
        cells = []
        for rows in results.values():
            t, total = mean(rows, f"time_{phase}"), mean(rows, "step_time")
            cells.append(f"{t:10.3f} s ({t / total:5.1%})" if t else f"{'-':>18}")
        print(f"{phase:<12}" + "".join(f"{c:>22}" for c in cells))
    print(f"{'step':<12}" + "".join(f"{mean(r, 'step_time'):>20.3f} s" for r in results.values()))
    print(f"{'tokens/s':<12}" + "".join(f"{mean(r, 'tokens_per_s'):>22.0f}" for r in results.values()))
    print("\nbytes moved per step (MB), and the step time it took")
    for label, key in (("experience", "buffer_bytes"), ("learner fetch", "fetch_bytes"), ("weight sync", "sync_bytes")):
        print(f"{label:<14}" + "".join(f"{mean(r, key) / 1e6:>20.2f}" for r in results.values()))
    for label, key in (("fetch time", "time_fetch"), ("update time", "time_update"), ("sync time", "time_sync")):
        cells = [f"{mean(r, key):8.4f} s ({mean(r, key) / mean(r, 'step_time'):5.1%})" for r in results.values()]
        print(f"{label:<14}" + "".join(f"{c:>20}" for c in cells))
    print(f"\n{'learn GFLOP/s':<12}" + "".join(f"{s['achieved'] / 1e9:>22.2f}" for s in speed.values()))
    for name in ("torch.mm", "oneDNN"):
        print(f"{'GEMM ' + name:<12}" + "".join(f"{s.get('gemm ' + name, math.nan) / 1e9:>22.2f}" for s in speed.values()))
    print(f"{'learn / GEMM':<12}" + "".join(f"{s['achieved'] / s['gemm']:>22.1%}" for s in speed.values()))
    print("(against the faster GEMM of the two)")
    print(f"{'update GEMMs':<12}" + "".join(f"{s['update'] / 1e9:>22.2f}" for s in speed.values()))
    print(f"{'learn / upd.':<12}" + "".join(f"{s['achieved'] / s['update']:>22.1%}" for s in speed.values()))
    print("(update GEMMs: an update's own matmuls, each timed alone at its shape, the learner's library)")
    if {"grpo", "ppo"} <= set(results):
        g, p = mean(results["grpo"], "step_time"), mean(results["ppo"], "step_time")
        print(f"\nPPO step / GRPO step = {p / g:.2f}x (PPO adds the critic's forward and update)")
    if {"grpo", "grpo/broadcast"} <= set(results):
        store, cast = mean(results["grpo"], "time_sync"), mean(results["grpo/broadcast"], "time_sync")
        print(f"weight sync, broadcast / object store = {cast / store:.2f}x")


if __name__ == "__main__":
    main()

"""raypo and TRL's GRPOTrainer on the same work, one after the other, side by side.

    .venv/bin/pip install -e '.[bench]'     # TRL, pinned
    .venv/bin/python bench/compare_trl.py [--steps 1000 --eval-every 100] [--model smollm2] [--off-policy-steps 0 1]

Both start from the same warm start (the embedded tiny model, or `--model smollm2`: SmolLM2-135M
imported as examples/smollm2 says), draw the same task's training prompts, sample `--prompts` x
`--group` completions per step (at most `--max-tokens` new tokens, temperature 1), score them
with the same reward (raypo's scorer for the task) and take one optimizer step per batch (AdamW,
lr `--lr` constant, no KL term (beta 0), no entropy bonus, clip 0.2, token-mean loss, grad norm
clipped at 1). raypo runs `train()` on a local Ray sized from this machine (rollout and learner
actors); TRL runs in this process after Ray is shut down, generating with transformers.

Every `--eval-every` steps each framework's policy is kept (raypo: its checkpoint; TRL: a copy
of the weights) and afterwards scored by one evaluation code, greedy decoding with transformers
on the held-out problems. Wall clock is the sum of step times (start-up, snapshots and
evaluation left out for both). Prints per framework: median and p90 step seconds,
completions/s, per-phase seconds, held-out accuracy against steps and against wall clock, and
the ratios raypo / TRL. Compare ratios from one run: the machine is shared and noisy.

What still differs, by design of each: raypo's learner has the node's threads when it runs
synchronously (roles take turns) and `resource.cpus_per_learner` threads (1 by default) when
the engine samples ahead beside it, which has the rest, and the node's share again once the engine
is idle (pipelines/rl/roles.py, actors/learner.py:Widening); TRL's one process
uses torch's default (every core) for generation and learning in turn (both counts are printed); TRL's ratio is 1 by
construction (one update per generation, no old log-probs), raypo's is taken against the log-probs
vLLM sampled with; the group std is offset by 1e-6 in raypo, 1e-4 in TRL; TRL's "generate" phase
includes scoring, raypo reports reward apart. Gradient checkpointing is off in both (TRL's
default is on).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipelines.config import load_config  # noqa: E402
from pipelines.data.dataset import load_task  # noqa: E402
from pipelines.data.evaluate import evaluate_problems, greedy_complete  # noqa: E402
from pipelines.data.tasks import reward_fields  # noqa: E402
from pipelines.models.resolve import resolve_model_path  # noqa: E402
from pipelines.rl.evaluation import reward_scorer  # noqa: E402
from pipelines.rl.trainer import train  # noqa: E402

MODELS = {  # --model -> (preset, its defaults for the shared settings)
    # tiny: 2,000 held-out problems (nearly its whole held-out split): on 500 an accuracy near 0.95 moves +-1 point
    # from one evaluation to the next by chance alone, as much as the curve climbs in 200 steps there
    "tiny": (
        ROOT / "configs" / "grpo_tiny.yaml",
        {"prompts": 16, "group": 8, "max_tokens": 5, "lr": 5e-5, "eval_problems": 2000},
    ),
    "smollm2": (
        ROOT / "examples" / "smollm2" / "grpo.yaml",
        {"prompts": 4, "group": 8, "max_tokens": 24, "lr": 1e-5, "eval_problems": 50},
    ),
}


def raypo_config(args, out_dir: str, off_policy_steps: int = 0):
    preset, _ = MODELS[args.model]
    return load_config(
        preset,
        [
            f"name=compare_{args.model}_ahead{off_policy_steps}", f"algo.off_policy_steps={off_policy_steps}",
            f"seed={args.seed}", f"output_dir={out_dir}", f"training.steps={args.steps}",
            f"training.batch_size={args.prompts * args.group}", f"training.minibatch_size={args.prompts * args.group}",
            "training.epochs=1", f"training.lr={args.lr}", "training.warmup_steps=0", f"training.save_every={args.eval_every}",
            "training.keep_checkpoints=100000", f"algo.group_size={args.group}", "algo.kl_coef=0", "algo.entropy_coef=0",
            "algo.clip_eps=0.2", "algo.aggregate=token-mean", f"inference.max_tokens={args.max_tokens}",
            "inference.temperature=1.0", "inference.top_p=1.0", "eval.every=0", "eval.samples=0",
            f"task.eval_problems={args.eval_problems}", *args.set,
        ],
    )  # fmt: skip


class Evaluator:
    """Held-out accuracy of a policy's weights (a model directory or a state dict)."""

    def __init__(self, cfg, model_dir: Path):
        self.cfg, self.model_dir = cfg, model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.problems = load_task(cfg, model_dir).sample(cfg.task.eval_problems, "heldout", cfg.seed)
        self.scorer = reward_scorer(cfg)

    def accuracy(self, weights: Path | dict) -> float:
        state = weights if isinstance(weights, dict) else load_file(str(next(Path(weights).glob("*.safetensors"))))
        missing, unexpected = self.model.load_state_dict(state, strict=False)  # a tied head is saved once
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise ValueError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
        greedy = partial(greedy_complete, self.model, self.tokenizer, max_new_tokens=self.cfg.inference.max_tokens)
        summary, _ = evaluate_problems(
            self.problems,
            greedy,
            lambda prompts, texts, fields: self.scorer.scores_by_term(prompts, texts, **fields),
            self.cfg.pass_threshold,
        )
        return summary.get("accuracy", summary["pass_rate"])


def run_raypo(cfg) -> dict:
    """raypo's run: per-step metrics and the checkpoints' policies by step."""
    import ray  # the driver's Ray session is raypo's alone: TRL runs after it is shut down

    ray.init(include_dashboard=False, log_to_driver=False)  # sized from this machine
    try:
        train(cfg)
    finally:
        ray.shutdown()
    run_dir = Path(cfg.output_dir) / cfg.name
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    snapshots = {int(p.name.split("_")[1]): p / "policy" for p in sorted((run_dir / "checkpoints").glob("step_*"))}
    snapshots[cfg.training.steps] = run_dir / "final"
    return {
        "threads": statistics.median(m["learner_threads"] for m in metrics),  # a step's mean over its update
        "step_s": [m["step_time"] for m in metrics],
        "phases": {p: [m.get(f"time_{p}", 0.0) for m in metrics] for p in ("generate", "reward", "learn", "sync")},
        "staleness": statistics.mean(m["staleness"] for m in metrics),
        "overlap": statistics.median(m["rollout_overlap"] for m in metrics),
        "snapshots": snapshots,
    }


def run_trl(cfg, args, model_dir: Path, out_dir: str) -> dict:
    """TRL's GRPOTrainer on the same prompts, reward and settings; weights copied every eval step."""
    from trl import GRPOConfig, GRPOTrainer  # the optional `bench` extra

    task = load_task(cfg, model_dir)
    stream = task.stream("train", cfg.seed)
    rows = [next(stream) for _ in range(args.steps * args.prompts)]
    fields = reward_fields(rows)  # the reward's columns, as raypo hands them to the same scorer
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in rows]} | fields)
    scorer = reward_scorer(cfg)

    def reward(prompts, completions, **columns):
        return scorer.scores_by_term(prompts, completions, **{k: columns[k] for k in fields})["combined"]

    timing = {"threads": torch.get_num_threads(), "step_s": [], "generate": [], "snapshots": {}}

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, *a, **kw):
            started = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **kw)
            timing["generate"].append(time.perf_counter() - started)
            return out

    class Clock(TrainerCallback):
        def on_step_begin(self, _args, state, control, **kw):
            self.started = time.perf_counter()

        def on_step_end(self, _args, state, control, model=None, **kw):
            timing["step_s"].append(time.perf_counter() - self.started)
            if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                timing["snapshots"][state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = GRPOConfig(
        output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group, gradient_accumulation_steps=1, num_iterations=1, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2,
        loss_type="dapo", scale_rewards="group", max_completion_length=args.max_tokens, temperature=1.0, top_p=1.0,
        gradient_checkpointing=False, use_vllm=False, use_cpu=True, bf16=False, seed=args.seed, save_strategy="no",
        report_to=[], logging_steps=10**9, disable_tqdm=True, shuffle_dataset=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = Timed(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[Clock()]
    )
    trainer.train()
    timing["phases"] = {"generate": timing.pop("generate"), "learn": []}
    timing["phases"]["learn"] = [s - g for s, g in zip(timing["step_s"], timing["phases"]["generate"], strict=True)]
    return timing


def summarize(name: str, run: dict, evaluator: Evaluator, completions: int) -> dict:
    steps = run["step_s"][1:]  # step 0 includes warm-up
    clock = [0.0]
    for s in run["step_s"]:
        clock.append(clock[-1] + s)
    curve = {0: evaluator.accuracy(evaluator.model_dir)}  # the same warm start for all
    curve |= {step: evaluator.accuracy(w) for step, w in sorted(run["snapshots"].items())}
    return {
        "name": name,
        **{k: run[k] for k in ("staleness", "overlap") if k in run},
        "threads": run["threads"],
        "first_s": run["step_s"][0],
        "median_s": statistics.median(steps),
        "p90_s": statistics.quantiles(steps, n=10)[-1] if len(steps) > 1 else steps[0],
        "completions_per_s": completions / statistics.median(steps),
        "phases": {p: statistics.median(v[1:]) for p, v in run["phases"].items() if len(v) > 1},
        "curve": {step: (acc, clock[min(step, len(clock) - 1)]) for step, acc in curve.items()},
    }


def wall_to(curve: dict, target: float) -> float | None:
    return next((wall for _, (acc, wall) in sorted(curve.items()) if acc >= target - 1e-9), None)


def report(results: list[dict], args) -> None:
    """One column per run, the last TRL's when it ran; the ratios are each raypo run's over TRL's."""
    trl = results[-1] if results[-1]["name"] == "TRL" else None
    ours = [r for r in results if r is not trl]
    print(
        f"\n{args.model}: {args.prompts} prompts x {args.group} samples per step, <= {args.max_tokens} new tokens, lr {args.lr}"
    )
    threads = ", ".join(f"{r['name']} {r['threads']:.2f}" for r in ours)
    print(f"threads (median step's mean): raypo's learner: {threads} (pipelines/rl/roles.py:learner_threads; rollout apart)"
          + (f"; TRL {trl['threads']} (torch's default, generation and learning in turn)" if trl else ""))  # fmt: skip
    ratio_heads = [f"{r['name']} / TRL" for r in ours] if trl else []
    print(f"{'':<28}" + "".join(f"{r['name']:>18}" for r in results) + "".join(f"{h:>22}" for h in ratio_heads))
    rows = [("first_s", "step 0 s (warm-up)"), ("median_s", "median step s"), ("p90_s", "p90 step s")]
    for key, label in [*rows, ("completions_per_s", "completions/s")]:
        ratios = [f"{r[key] / trl[key]:>22.2f}" for r in ours] if trl else []
        print(f"{label:<28}" + "".join(f"{r[key]:>18.3f}" for r in results) + "".join(ratios))
    for r in results:
        extra = f"; staleness {r['staleness']:.2f}, rollout overlap {r['overlap']:.2f}" if "staleness" in r else ""
        print(f"{r['name']} phases (median s): " + ", ".join(f"{p} {t:.3f}" for p, t in r["phases"].items()) + extra)
    print(f"\n{'step':>6}" + "".join(f"{r['name'] + ' acc':>18}{'wall s':>10}" for r in results))
    for step in sorted(set().union(*(r["curve"] for r in results))):
        cells = [r["curve"].get(step, (float("nan"),) * 2) for r in results]
        print(f"{step:>6}" + "".join(f"{acc:>18.3f}{wall:>10.1f}" for acc, wall in cells))
    # The yardstick is TRL's final accuracy; where both saturate, fixed levels say more.
    finals = {round(r["curve"][max(r["curve"])][0], 3) for r in ([trl] if trl else ours)}
    heads = "".join(f"{r['name']:>18}" for r in results) + "".join(f"{h:>22}" for h in ratio_heads)
    print(f"\n{'wall s to accuracy':<20}{heads}")
    for target in sorted({0.9, 0.95, 0.99} | finals):
        walls = [wall_to(r["curve"], target) for r in results]
        cells = [f"{w:>18.1f}" if w is not None else f"{'not reached':>18}" for w in walls]
        theirs = walls[-1] if trl else None
        ratios = [f"{w / theirs:>22.2f}" if w and theirs else f"{'-':>22}" for w in walls[: len(ours)]] if trl else []
        print(f"{target:<20.3f}{''.join(cells)}{''.join(ratios)}")
    if trl:
        # The same target against the wall time TRL took for all its steps (the run that gave it that
        # accuracy): where TRL still improves at its last step the two readings agree; where it has
        # long saturated, its first evaluation at its final value is a draw from the plateau.
        last = max(trl["curve"])
        final, total = trl["curve"][last]
        reached = [wall_to(r["curve"], round(final, 3)) for r in ours]
        cells = [
            f"{r['name']} {w:.1f} s ({w / total:.2f}x)" if w is not None else f"{r['name']} not reached"
            for r, w in zip(ours, reached, strict=True)
        ]
        print(f"TRL's accuracy at step {last}, {final:.3f}, after its {total:.1f} s of steps; reached by " + ", ".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--prompts", type=int, help="prompts per step (tiny 16, smollm2 4)")
    parser.add_argument("--group", type=int, help="samples per prompt (8)")
    parser.add_argument("--max-tokens", type=int, help="most new tokens (tiny 5, smollm2 24)")
    parser.add_argument("--lr", type=float, help="learning rate (tiny 5e-5, smollm2 1e-5)")
    parser.add_argument("--eval-problems", type=int, help="held-out problems each evaluation scores (tiny 2000, smollm2 50)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--off-policy-steps", type=int, nargs="+", default=[0], help="one raypo run per value of algo.off_policy_steps (0)"
    )
    parser.add_argument("--no-trl", action="store_true", help="raypo's runs only")
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="KEY=VALUE", help="raypo config overrides (training.micro_batch_size=8)"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    for key, value in MODELS[args.model][1].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    with tempfile.TemporaryDirectory(prefix="raypo-compare-") as tmp:
        runs = {}
        for ahead in args.off_policy_steps:
            cfg = raypo_config(args, tmp, ahead)
            runs[f"raypo ahead {ahead}" if len(args.off_policy_steps) > 1 or ahead else "raypo"] = run_raypo(cfg)
        model_dir = resolve_model_path(cfg)
        if not args.no_trl:
            runs["TRL"] = run_trl(cfg, args, model_dir, str(Path(tmp) / "trl"))
        evaluator = Evaluator(cfg, model_dir)
        completions = args.prompts * args.group
        results = [summarize(name, run, evaluator, completions) for name, run in runs.items()]
    report(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The RL driver: builds the roles, runs an algorithm's step in a loop, and writes the run.

`train(cfg)` is the one entry point that the CLI, Ray Jobs and Ray Tune trials call: config
in, summary out, each step's metrics to an optional callback. Outputs go to the run's storage,
<training.storage_path>/<name> (else <output_dir>/<name>, made absolute): metrics.jsonl,
summary.json, tensorboard/, reward_curve.png, checkpoints/step_N (Hugging Face weights +
optimizer and step state, for --resume) and final/ (the trained policy). Where the storage is
a URI, the driver keeps its own files in <output_dir>/<name> and uploads them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import ray
import ray.exceptions as rex
from ray.util.placement_group import PlacementGroup
from tqdm import tqdm

from actors.learner import LearnerLost
from actors.placement import Placement
from pipelines.cluster import connect_ray
from pipelines.config import RaypoConfig
from pipelines.data import storage
from pipelines.data.dataset import load_task
from pipelines.data.evaluate import write_rows
from pipelines.data.preferences import heldout_pairs
from pipelines.data.tasks import Problem, Task
from pipelines.models.resolve import resolve_model_path
from pipelines.registry import Registry
from pipelines.rl.checkpoints import load_checkpoint, save_checkpoint
from pipelines.rl.dpo import dpo_evaluate, dpo_step
from pipelines.rl.evaluation import StaleEvaluation, launch_evaluation
from pipelines.rl.grpo import grpo_step
from pipelines.rl.monitor import Alerts, Sinks
from pipelines.rl.phases import prompts_at, restart_engines
from pipelines.rl.ppo import ppo_step
from pipelines.rl.recovery import RecoveryError, UpdateGuard
from pipelines.rl.roles import Roles, build_roles, learner_spec, reserve, resource_plan

MetricsCallback = Callable[[dict], None]


@dataclass(frozen=True)
class Pipeline:
    """An algorithm's training step, `step(roles, cfg, step, problems) -> metrics`, and what it
    adds to the held-out evaluation, `evaluate(roles, cfg, problems) -> metrics` (None: nothing)."""

    step: Callable[..., dict]
    evaluate: Callable[..., dict] | None = None


PIPELINES: Registry[Pipeline] = Registry("algorithm pipeline")
PIPELINES.register("grpo")(Pipeline(grpo_step))
PIPELINES.register("gspo")(Pipeline(grpo_step))  # GRPO's pipeline; config gives algo.name=gspo the sequence-level policy loss
PIPELINES.register("ppo")(Pipeline(ppo_step))
PIPELINES.register("dpo")(Pipeline(dpo_step, evaluate=dpo_evaluate))


# Shown beside the progress bar when a step reports them (RL: reward and KL; DPO: loss and reward accuracy).
PROGRESS_KEYS = ("reward_mean", "kl", "loss", "reward_accuracy", "step_time")


class TrainingError(RuntimeError):
    """A run stopped; the message names the cause. The last checkpoint is left intact."""


# The driver's own files of a run, uploaded to the run's storage when it is a URI.
DRIVER_FILES = ("metrics.jsonl", "summary.json", "tensorboard", "reward_curve.png", "placement.json")


def run_location(cfg: RaypoConfig) -> str:
    """Where a run's outputs go: <training.storage_path>/<name>, else <output_dir>/<name> as an
    absolute path (actors on other nodes, or in a Ray Job's working directory, see the same path)."""
    if cfg.training.storage_path:
        root = cfg.training.storage_path
        return storage.join(root if storage.is_uri(root) else str(storage.local_path(root)), cfg.name)
    return str(storage.local_path(cfg.output_dir) / cfg.name)


class Trainer:
    def __init__(
        self, cfg: RaypoConfig, model_dir: Path, task: Task, placement: Placement, on_metrics: MetricsCallback | None = None
    ):
        if cfg.algo.name not in PIPELINES:
            raise TrainingError(f"algorithm {cfg.algo.name!r} has no RL pipeline yet; known: {', '.join(PIPELINES.names())}")
        self.cfg, self.model_dir, self.task, self.on_metrics = cfg, model_dir, task, on_metrics
        self.pipeline = PIPELINES.get(cfg.algo.name)
        self.location = run_location(cfg)
        remote = storage.is_uri(self.location)
        self.out_dir = storage.local_path(cfg.output_dir) / cfg.name if remote else Path(self.location)
        self.ckpt_root = storage.join(self.location, "checkpoints")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.eval_problems = self.task.sample(cfg.task.eval_problems, "heldout", cfg.seed)
        # where a refreshed reward model's Kendall tau is measured (the pairs raypo train-rm checks on)
        self.rm_heldout = heldout_pairs(self.eval_problems, cfg.seed) if cfg.reward.refresh_every else []
        self.roles: Roles = build_roles(cfg, model_dir, self.out_dir, placement, self.ckpt_root)
        self.placement = placement.where()
        for where in self.placement:
            node = f"{where['node_ip']} {(where['node_id'] or '?')[-8:]}"
            print(f"placed {where['role']} on node {node} (type {where['node_type'] or 'none'})", flush=True)
        (self.out_dir / "placement.json").write_text(json.dumps(self.placement, indent=2))

    def upload(self) -> None:
        """Copy the driver's files to the run's storage (nothing to do when that is out_dir)."""
        names = [*DRIVER_FILES, *(p.name for p in self.out_dir.glob("eval_*.jsonl"))]
        storage.upload_files(self.out_dir, names, self.location)

    def evaluate(self, label: str) -> dict:
        """The held-out evaluation with the current weights (first rollout engine, reward actor);
        writes its per-sample rows to eval_<label>.jsonl and returns the summary. Begun again
        where the engine was restarted between the look for a restart and the evaluation's calls."""
        tries = self.cfg.resource.max_actor_restarts + 1
        for _ in range(tries):
            finish = self._launch_evaluation(engine_idle=True)
            try:
                return self._evaluated(label, finish())
            except StaleEvaluation:
                continue  # the next look finds the restart and gives the engine the weights
        raise RecoveryError(f"the {label} evaluation's engine, rollout-0, was restarted under it at each of {tries} tries")

    def _launch_evaluation(self, engine_idle: bool) -> Callable[[], tuple[dict, list[dict]]]:
        """`launch_evaluation` with the current weights: what it needs of the learners (the
        pipeline's own part, DPO's) is done now; returns the rest, as `launch_evaluation` does.
        The evaluation's engine, if Ray restarted it, is given the current weights first where it
        is `engine_idle`; busy with a batch sampled ahead, asking it would wait for that batch:
        an evaluation on a restarted engine's starting weights is then reported lost
        (`StaleEvaluation`), and the engine gets the weights at its next share."""
        if engine_idle:
            restart_engines(self.roles, [0])
        finish = launch_evaluation(self.roles, self.cfg, self.eval_problems)
        extra = self.pipeline.evaluate(self.roles, self.cfg, self.eval_problems) if self.pipeline.evaluate else {}

        def finished() -> tuple[dict, list[dict]]:
            summary, rows = finish()
            return summary | extra, rows

        return finished

    def _evaluated(self, label: str, result: tuple[dict, list[dict]]) -> dict:
        summary, rows = result
        write_rows(self.out_dir / f"eval_{label}.jsonl", rows)
        return summary

    # ------------------------------------------------------------------ the loop
    def run(self, resume: bool = False) -> dict:
        cfg, started = self.cfg, time.monotonic()
        state = self._resume() if resume else {}
        start_step = state.get("step", 0)
        if "eval_start" not in state:
            state["eval_start"] = self.evaluate("start")
        sinks = Sinks(self.out_dir, resume_step=start_step, run=cfg.name)
        bar = tqdm(total=cfg.training.steps, initial=start_step, desc=f"{cfg.algo.name} {cfg.name}", dynamic_ncols=True)
        end_step, rebuilds = start_step, 0
        try:
            while True:
                try:
                    end_step = self._steps(end_step, state, sinks, bar)
                    break
                except LearnerLost as lost:
                    rebuilds += 1
                    end_step = self._rebuild_learners(lost, rebuilds, state)
                    sinks.rewind(end_step)
                    bar.n = end_step
                    bar.refresh()
        finally:
            bar.close()
            sinks.plot_rewards() if sinks.history else None
            sinks.close()
        ckpt = save_checkpoint(self.roles, self.ckpt_root, end_step, state, cfg.training.keep_checkpoints)
        final = storage.join(self.location, "final")
        storage.copy_dir(storage.join(ckpt, "policy"), final)
        eval_end = self.evaluate("end")
        accuracy = {"eval_accuracy_start": state["eval_start"].get("accuracy"), "eval_accuracy_end": eval_end.get("accuracy")}
        summary = {
            "name": cfg.name,
            "algo": cfg.algo.name,
            "steps": end_step,
            "eval_problems": len(self.eval_problems),
            **(accuracy if "accuracy" in eval_end else {}),  # exact-answer accuracy, where every problem has an answer
            "eval_start": state["eval_start"],
            "eval_end": eval_end,
            "final_reward_mean": sinks.history[-1].get("reward_mean") if sinks.history else None,
            "wall_seconds": round(time.monotonic() - started, 1),
            "checkpoint": ckpt,
            "policy": final,
            "storage": self.location,
            "placement": self.placement,
        }
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.upload()
        return summary

    def _steps(self, start_step: int, state: dict, sinks: Sinks, bar: tqdm) -> int:
        """Train from `start_step` to the end (the prompt stream, alerts and update counts taken
        up from the metrics of the steps before); returns the steps done."""
        cfg = self.cfg
        stream = self.task.stream("train", cfg.seed)
        for _ in range(sum(prompts_at(cfg, s) for s in range(start_step))):  # the prompts earlier steps used
            next(stream)
        span = 2.0 if cfg.reward.normalize else cfg.reward.value_range[1] - cfg.reward.value_range[0]
        alerts = Alerts(cfg.monitor, reward_span=span)
        for past in sinks.history:
            alerts.check(past)
        guard = UpdateGuard(cfg.training, sinks.history, lr_scale=state.get("lr_scale", 1.0))
        ahead = cfg.algo.off_policy_steps
        self.roles.upcoming.clear()
        self.roles.ahead.clear()
        self.roles.after_generation.clear()
        # Running ahead, the engines are busy with the next step's batch now: they are watched when it is collected.
        watched = [role for role in self.roles.watch.actors if not (ahead and role.startswith("rollout-"))]
        # An evaluation every `eval.every` steps runs beside the next step (`_evaluate_beside`): (its step, its result).
        evaluating = self._evaluation_owed(start_step)
        for step in range(start_step, cfg.training.steps):
            metrics = self._one_step(step, self._prompts(step, stream))
            if guard.record(metrics):
                metrics |= self._roll_back(step, guard, state)
                self.roles.ahead.clear()  # sampled with the weights rolled back from: sampled again
            if not ahead:
                restart_engines(self.roles, range(len(self.roles.rollouts)))  # an engine restarted since: the current weights
            self.roles.watch.restarted(watched)  # logs the roles Ray restarted during the step (it re-ran their calls)
            metrics["actor_restarts"] = self.roles.watch.total()
            if evaluating is not None:  # the one begun after the step before (scored before a reward refresh)
                metrics |= self._evaluated_beside(*evaluating)
                evaluating = None
            if cfg.reward.refresh_every and (step + 1) % cfg.reward.refresh_every == 0:
                metrics |= ray.get(self.roles.reward.refresh.remote(self.rm_heldout))
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < cfg.training.steps:
                evaluating = (step + 1, self._evaluate_beside())
            metrics["alerts"] = alerts.check(metrics)
            for alert in alerts.to_print(step, metrics["alerts"]):
                bar.write(f"warning: step {step}: {alert}")
            sinks.write(metrics)
            if self.on_metrics:
                self.on_metrics(metrics)
            bar.set_postfix({k: f"{metrics[k]:.4g}" for k in PROGRESS_KEYS if metrics.get(k) is not None})
            bar.update()
            every = cfg.training.save_every
            if every and (step + 1) % every == 0 and step + 1 < cfg.training.steps:
                streak_from = step - guard.failed_in_a_row + 1 if guard.failed_in_a_row else None  # a rollback's target stays
                save_checkpoint(self.roles, self.ckpt_root, step + 1, state, cfg.training.keep_checkpoints, streak_from)
                self.upload()
        return max(cfg.training.steps, start_step)

    def _evaluate_beside(self) -> Future:
        """The evaluation of the current weights, off the step loop's path, beside the next step:
        the first engine's calls are queued once that step's batch is generated, behind it (and a
        batch sampled ahead) and ahead of the weight sync, so they run on these weights while the
        learners train; a thread waits for them and scores them, and the loop takes the result
        after that step. An algorithm that generates nothing (DPO) queues them at once."""
        result: Future = Future()

        def launch() -> None:
            finish = self._launch_evaluation(engine_idle=not self.cfg.algo.off_policy_steps)
            # a daemon: one waiting on an engine that hangs does not keep the process from exiting
            threading.Thread(target=_settle, args=(result, finish), name="raypo-eval", daemon=True).start()

        self.roles.after_generation.append(launch) if self.cfg.algo.generates else launch()
        return result

    def _evaluated_beside(self, done_at: int, result: Future) -> dict:
        """The metrics of the evaluation begun after step `done_at` (`_evaluate_beside`), once done.
        One whose engine or reward actor died under it, or that ran on an engine Ray restarted
        before it (`StaleEvaluation`), is lost, said on stderr (`eval/failed`): Ray restarts the
        actor, the engine is given the weights, and the run goes on."""
        self.roles.generated()  # not queued yet (a step that generated nothing): now
        try:
            summary = self._evaluated(f"step_{done_at}", result.result())
        except (rex.RayActorError, StaleEvaluation) as err:
            cause = str(err).splitlines()[0][:300]
            how = "ran on a restarted engine" if isinstance(err, StaleEvaluation) else "an actor it ran on died"
            print(f"warning: the evaluation of step {done_at} is lost: {how} ({cause})", file=sys.stderr)
            return {"eval/failed": 1.0, "eval/step": done_at}
        return {f"eval/{k}": v for k, v in summary.items()} | {"eval/step": done_at}

    def _evaluation_owed(self, start_step: int) -> tuple[int, Future] | None:
        """Taking up at `start_step` (a resume, a rebuilt learner group): the evaluation due after
        the step before, which the run that saved the checkpoint began but had not reported yet,
        begins again (its metrics go with the step it runs beside, as always)."""
        every = self.cfg.eval.every
        if every and 0 < start_step < self.cfg.training.steps and start_step % every == 0:
            return start_step, self._evaluate_beside()
        return None

    def _prompts(self, step: int, stream: Iterator[Problem]) -> list[Problem]:
        """The prompts of `step`, drawn from `stream` with those of the steps sampled ahead of it
        (algo.off_policy_steps), which wait in `roles.upcoming`."""
        upcoming = self.roles.upcoming
        for s in range(step, min(step + self.cfg.algo.off_policy_steps, self.cfg.training.steps - 1) + 1):
            if s not in upcoming:
                upcoming[s] = [next(stream) for _ in range(prompts_at(self.cfg, s))]
        return upcoming.pop(step)

    def _rebuild_learners(self, lost: LearnerLost, rebuilds: int, state: dict) -> int:
        """A learner rank died (the group was stopped at once): a new group in the same bundles,
        restored from the newest whole checkpoint (else the starting weights), the engines given
        its weights. Returns the step to train on from; the metrics after it are dropped."""
        bound = self.cfg.resource.max_actor_restarts
        if rebuilds > bound:
            raise TrainingError(f"{lost}; the learners were rebuilt {bound} times already (resource.max_actor_restarts)")
        started = time.monotonic()
        self.roles.ahead.clear()  # sampled with the lost weights: the steps trained again sample again
        self.roles.rebuild_learners(learner_spec(self.cfg, self.model_dir))
        ckpt, _ = storage.newest_whole(self.ckpt_root)
        restored = load_checkpoint(self.roles, ckpt) if ckpt else {"step": 0}
        if not ckpt:
            self.roles.weight_sync.push(0)  # the starting weights, which the new group holds
        state.update({k: v for k, v in restored.items() if k != "step"})
        print(
            f"recovered: {lost}; the learners were rebuilt from {ckpt or 'the starting weights'} in "
            f"{time.monotonic() - started:.1f} s (rebuild {rebuilds} of {bound}); training again from step {restored['step']}",
            file=sys.stderr,
            flush=True,
        )
        return restored["step"]

    def _resume(self) -> dict:
        """The trainer's state at the newest whole checkpoint, whose weights the roles now hold."""
        ckpt, skipped = storage.newest_whole(self.ckpt_root)
        for name, why in skipped:
            print(f"--resume: skipped checkpoint {name}: {why}", file=sys.stderr, flush=True)
        if ckpt is None:
            found = f" ({len(skipped)} found, none whole)" if skipped else ""
            raise TrainingError(f"--resume: no whole checkpoint under {self.ckpt_root}{found}")
        state = load_checkpoint(self.roles, ckpt)
        if storage.is_uri(self.location) and (metrics := storage.read_text(storage.join(self.location, "metrics.jsonl"))):
            (self.out_dir / "metrics.jsonl").write_text(metrics)  # the steps before the checkpoint, kept by Sinks
        print(f"resumed from {ckpt} at step {state['step']}")
        return state

    def _roll_back(self, step: int, guard: UpdateGuard, state: dict) -> dict:
        """The seeds' rule after `training.rollback_after` failed updates in a row: the learners
        (and critic, reward model) and the engines back to the newest whole checkpoint from before
        the first failure, the learning rate lowered by `training.rollback_lr_factor`."""
        failed, first = guard.failed_in_a_row, step - guard.failed_in_a_row + 1
        ckpt, _ = storage.newest_whole(self.ckpt_root, at_most=first)
        if ckpt is None:
            raise TrainingError(
                f"{failed} updates in a row failed (non-finite loss or gradient, steps {first}-{step}) and there is no "
                f"checkpoint from step {first} or before to roll back to: lower training.lr, or save sooner (training.save_every)"
            )
        load_checkpoint(self.roles, ckpt)
        state["lr_scale"] = guard.rolled_back()
        self.roles.learners.run("set_lr_scale", state["lr_scale"])
        print(
            f"step {step}: {failed} updates in a row failed (non-finite loss or gradient); rolled back to {ckpt}, "
            f"learning rate x{state['lr_scale']:g}",
            file=sys.stderr,
            flush=True,
        )
        return {"rollback_to": storage.step_of(ckpt), "lr_scale": state["lr_scale"]}

    def _one_step(self, step: int, problems: list[Problem]) -> dict:
        started = time.monotonic()
        metrics = self.pipeline.step(self.roles, self.cfg, step, problems)
        out = {"step": step, **metrics, "step_time": time.monotonic() - started}  # phases overlap: wall time
        if "time_generate_busy" in metrics:
            busy = max(metrics["time_generate_busy"], 1e-9)
            out["tokens_per_s"] = metrics["response_tokens"] / busy
            # the updates the weights that sampled the batch lag behind (algo.off_policy_steps), and the
            # share of the engines' sampling that ran hidden behind the step before
            out["staleness"] = step - metrics["weights_version"]
            out["rollout_overlap"] = min(1.0, max(0.0, 1.0 - metrics["time_generate"] / busy))
        return out


def _settle(future: Future, work: Callable[[], object]) -> None:
    """Run `work`, giving `future` its result or its error."""
    try:
        future.set_result(work())
    except BaseException as err:
        future.set_exception(err)


def _describe_failure(err: BaseException) -> str:
    """A one-line cause for a Ray failure: the error inside the task or actor, with its root
    cause when its own message says nothing (`BackendCompilerFailed: backend='inductor' raised:`)."""
    if isinstance(err, rex.RayTaskError):
        inner = err.__dict__.get("cause") or err
        return with_root_cause(f"{type(inner).__name__}: {inner}", str(err))
    if isinstance(err, rex.ActorDiedError | rex.RayActorError):
        text = str(err)
        if "creation task" in text:  # the actor's __init__ raised; its traceback is in the text
            return f"an actor failed to start: {root_cause(text)}"
        return f"an actor died: {text.splitlines()[0][:300]}"
    return with_root_cause(f"{type(err).__name__}: {err}", "".join(traceback.format_exception(err)))


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Z]\w*(?:Error|Exception|Failed|Exit|Interrupt)\w*): ?(.*)$")


def _says_nothing(message: str) -> bool:
    return len(message.strip()) < 30 or message.strip().endswith(":")


def root_cause(traceback_text: str) -> str:
    """`Type: message` of the first exception a traceback names (the root of a chain: Python
    prints it first), plus the first line naming an error when the message alone says nothing.

    >>> root_cause("Traceback (most recent call last):\\n  File 'x.py', line 1\\nCppCompileError: C++ compile error\\n"
    ...            "Command: g++ -O3 x.cpp\\nx.cpp:9: error: 'at::vec' has not been declared\\n")
    "CppCompileError: C++ compile error x.cpp:9: error: 'at::vec' has not been declared"
    """
    lines = [line.strip() for line in traceback_text.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if match := _EXCEPTION_LINE.match(line):
            head, message, rest = match.group(1), match.group(2), lines[i + 1 : i + 80]
            break
    else:
        return (lines[0] if lines else "unknown error")[:600]
    if _says_nothing(message):
        named = [line for line in rest if "error:" in line.lower()] or [line for line in rest if "error" in line.lower()]
        message = f"{message} {(named or rest or [''])[0]}".strip()
    return f"{head}: {message}"[:600]


def with_root_cause(summary: str, traceback_text: str) -> str:
    """`summary`'s first line, and the root cause from `traceback_text` when that line says nothing."""
    first = (summary.strip().splitlines() or [""])[0]
    if not _says_nothing(first.partition(": ")[2] if ": " in first else first):
        return first[:500]
    root = root_cause(traceback_text)
    return first[:200] if root.startswith(first) else f"{first[:200]} caused by {root}"


def train(
    cfg: RaypoConfig,
    address: str | None = None,
    on_metrics: MetricsCallback | None = None,
    resume: bool = False,
    trial_group: PlacementGroup | None = None,
) -> dict:
    """Train with `cfg` on the Ray cluster at `address` (or RAY_ADDRESS), else on a local Ray
    that this call starts and stops; inside a Ray Tune trial, in the trial's placement group
    `trial_group` (reserved from `resource_plan`). Returns the run's summary; raises TrainingError."""
    model_dir = resolve_model_path(cfg)
    task = load_task(cfg, model_dir)  # a bad dataset stops the run here, before Ray and its actors start
    with ray_session(cfg, address) as local_ray:
        placement = reserve(cfg, resource_plan, local_ray, trial_group)
        try:
            trainer = Trainer(cfg, model_dir, task, placement, on_metrics)
        except BaseException:
            placement.remove()  # on a joined cluster nothing else would free it
            raise
        try:
            return trainer.run(resume=resume)
        finally:
            trainer.roles.shutdown()


@contextlib.contextmanager
def ray_session(cfg: RaypoConfig, address: str | None = None) -> Iterator[bool]:
    """A run's Ray: the cluster at `address` (or RAY_ADDRESS), else a local Ray sized from this
    machine, started here and stopped at the end. Yields whether it is local. A Ray failure
    inside becomes a TrainingError naming its cause; SIGTERM ends the run through the same exits."""
    pin_cpus(cfg.resource.cpu_affinity)
    started_ray = False
    if not ray.is_initialized():
        try:
            started_ray = connect_ray(address, include_dashboard=False, log_to_driver=False)
        except ConnectionError as err:
            raise TrainingError(str(err)) from err
    # Only the main thread may set a signal handler; a Tune trial or a caller's thread leaves
    # SIGTERM to whoever owns the process.
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm) if on_main_thread else None
    try:
        yield started_ray
    except (rex.RayError, rex.RayTaskError) as err:
        raise TrainingError(_describe_failure(err)) from err
    except (RecoveryError, LearnerLost) as err:  # past the bound, or a learner lost outside the steps (a final save)
        raise TrainingError(str(err)) from err
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)
        if started_ray:
            ray.shutdown()


def pin_cpus(cores: list[int]) -> None:
    """Run this process, and what it starts from now on (a local Ray), on `cores` that this
    machine has (`resource.cpu_affinity`; empty = all). Cores it lacks are named and skipped."""
    if not cores:
        return
    have = os.sched_getaffinity(0)
    usable = sorted(set(cores) & have)
    if not usable:
        raise TrainingError(f"resource.cpu_affinity {cores} names none of this machine's cores {sorted(have)}")
    if len(usable) < len(cores):
        missing = sorted(set(cores) - have)
        print(f"warning: resource.cpu_affinity: cores {missing} are not on this machine; using {usable}", file=sys.stderr)
    os.sched_setaffinity(0, usable)


def _raise_on_sigterm(signum, frame):
    raise SystemExit(f"stopped by signal {signum}")  # runs the finally blocks: Ray is shut down

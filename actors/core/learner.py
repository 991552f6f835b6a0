"""Learner: the Ray-free core of a learner actor, a Hugging Face causal LM under DeepSpeed.

One `Learner` is one rank of a torch.distributed world (gloo on CPU, nccl on GPU). Each rank
receives only its own rows of every minibatch (`actors.core.minibatch.Shard`, zero-copy numpy
from the object store) and normalises its loss by the whole minibatch's token count, which the
shard carries, so the world's update equals one learner's update on the whole batch, whatever
the world size.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from actors.core.clipping import clip_in_step
from actors.core.minibatch import Shard
from actors.core.modeling import (
    COMPLETIONS,
    along_response,
    completion_logprobs,
    completion_scores,
    loss_mask,
    packed_token_logprobs,
    sequence_tensors,
)
from actors.core.onednn import use_onednn
from actors.core.weight_sync import layout_of, open_group, send
from pipelines.algos.losses import (
    POLICY_LOSSES,
    DPOSpec,
    LossSpec,
    Normalizers,
    bradley_terry_loss,
    decoupled_targets,
    dpo_loss,
    kl_penalty,
    masked_aggregate,
)
from pipelines.algos.sampling import SamplingSpec, token_logprobs_and_entropy
from pipelines.data.preferences import pad_id

EVAL_CHUNK = 64  # pairs per forward pass when a learner scores a whole evaluation set
# A policy update's metrics that are sums over its rows (each divided by the whole minibatch's
# counts), so micro-batches' values add up; the others are means over a micro-batch's tokens.
ADDITIVE = frozenset({"loss", "pg_loss", "entropy", "kl", "kl_loss"})


@dataclass(frozen=True)
class LearnerSpec:
    """What a learner needs to know, independent of the config tree (so actors pickle it)."""

    model_dir: str
    lr: float = 3e-5
    warmup_steps: int = 0  # optimizer steps of linear lr warmup (Adam's first steps are full-size)
    grad_clip: float = 1.0
    zero_stage: int = 0
    bf16: bool = False
    gradient_checkpointing: bool = False
    micro_batch_size: int = 0  # most rows per forward/backward of a policy update (0: a rank's whole share)
    sampling: SamplingSpec = SamplingSpec()  # how the rollout samples: the policy is that distribution
    seed: int = 0
    use_gpu: bool = False
    head: str = "lm"  # lm: the causal LM (a policy); score: a one-logit sequence-classification head (a reward model)
    l2_coef: float = 0.0  # L2 regularisation of the weights (Adam's coupled weight decay), for a reward model


class Learner:
    def __init__(
        self, spec: LearnerSpec, rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1", master_port: int = 29500
    ):
        import deepspeed  # heavy (JIT-built ops): only a learner process loads it

        self.spec, self.rank, self.world_size = spec, rank, world_size
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK="0" if not spec.use_gpu else os.environ.get("LOCAL_RANK", "0"),
        )
        torch.manual_seed(spec.seed)
        deepspeed.init_distributed(dist_backend="nccl" if spec.use_gpu else "gloo", auto_mpi_discovery=False)
        model = _load_model(spec)
        if not spec.use_gpu and spec.zero_stage < 3:  # ZeRO-3 wraps F.linear to gather partitioned weights
            use_onednn(model)  # float32 matmuls at this CPU's speed (actors/core/onednn.py)
        if spec.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.tokenizer_dir = spec.model_dir
        # fused: one pass over each tensor (6x faster than the per-tensor loop at 135M parameters on one core)
        if spec.l2_coef:  # Adam's weight decay adds l2 * w to the gradient: the L2 penalty (l2 / 2) * |w|^2
            optimizer = torch.optim.Adam(model.parameters(), lr=spec.lr, weight_decay=spec.l2_coef, fused=True)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0, fused=True)
        self.optimizer = optimizer  # DeepSpeed steps it as it is in float32 without ZeRO: where raypo clips
        # float32 without ZeRO: raypo clips, with one norm over all gradients that is also the
        # metric (DeepSpeed would take its own norm, parameter by parameter, and not keep it).
        self.clips_here = spec.zero_stage == 0 and not spec.bf16
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,  # raypo shapes batches itself; one backward per optimizer step
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0 if self.clips_here else spec.grad_clip,
            "zero_optimization": {"stage": spec.zero_stage},
            "zero_allow_untested_optimizer": True,  # a plain torch AdamW avoids DeepSpeed's JIT-built Adam ops
            "bf16": {"enabled": spec.bf16},
            "steps_per_print": 1 << 30,
        }
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        if world_size == 1 and spec.zero_stage == 0:
            # Alone, there is nothing to average: DeepSpeed would still copy every gradient into a
            # flat buffer and back after each backward (a second per update at 135M parameters).
            self.engine.enable_backward_allreduce = False
        self.steps_done = 0
        self.optimizer_steps = 0
        self.lr_scale = 1.0  # lowered by the driver's rollback after failed updates
        # Called after each decoder layer's forward and before its backward: where the actor,
        # sampling ahead, widens torch's threads once the engine beside it is idle (actors/learner.py).
        self.between_layers: Callable[[], None] = lambda: None
        for layer in _decoder_layers(self.model):
            layer.register_forward_hook(self._after_layer)

    @property
    def model(self):
        return self.engine.module

    def _after_layer(self, module, args, output) -> None:
        self.between_layers()
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:  # a tensor hook runs as the backward reaches this layer's output
            hidden.register_hook(lambda grad: self.between_layers())

    @torch.no_grad()
    def logprobs(self, batch: Mapping[str, np.ndarray]) -> np.ndarray:
        """Log-probs `[N, T]` of the batch's response tokens under the current weights (all rows),
        in the sampling distribution (temperature, top-k, top-p) the rollout draws from."""
        self.engine.eval()
        inputs = sequence_tensors(batch, np.arange(len(batch["response_ids"])))
        logp, _, _ = self._policy(inputs)
        return (logp * inputs["response_mask"]).numpy().astype(np.float32)

    def _policy(
        self, inputs: dict[str, torch.Tensor], entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`[n, T]` each: the log-prob of each response token under the distribution the rollout
        samples from, under the full softmax (for the KL to the untruncated reference), and the
        sampling distribution's entropy at each position (pipelines/algos/sampling.py), with a
        graph only when `entropy_grad` (a loss term)."""
        sampling = self.spec.sampling
        if not sampling.truncates:  # the full softmax: the head and log-probs fused, where rows pack
            fused = packed_token_logprobs(self.engine, inputs, sampling.temperature, with_entropy=True, entropy_grad=entropy_grad)
            if fused is not None:
                logp, entropy = fused
                return logp, logp, entropy

        def per_part(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return token_logprobs_and_entropy(logits, ids, sampling, entropy_grad)

        return along_response(self.engine, inputs, sampling.temperature, per_part)

    def train_step(self, minibatches: Iterable[Shard], loss: LossSpec) -> dict[str, float]:
        """Policy update on a step's experience, one optimizer step per minibatch, of which each
        rank gets its own rows (`actors.core.minibatch.shards`).

        Each needs `advantages` and `behaviour_logprobs` `[n, T]`; `reference_logprobs` for the KL;
        `scored` `[n]` (optional) leaves the samples no reward scored out of the loss. A minibatch
        with no scored sample takes no optimizer step. Returns metrics averaged over the
        minibatches (and identical on every rank).
        """
        self.engine.train()
        if loss.behaviour_weight_cap is not None:
            minibatches = self._with_proximal(list(minibatches))
        results = [r for r in (self._minibatch_step(mb, loss) for mb in minibatches) if r is not None]
        if not results:
            raise ValueError("no sample of this step has a reward (all unscored): nothing to learn from")
        return self._steps_done(results)

    @torch.no_grad()
    def _with_proximal(self, minibatches: list[Shard]) -> list[Shard]:
        """Decoupled PPO's proximal policy is the weights before this step's first update. With one
        minibatch the loss reads it off its own forward pass (the weights have not moved yet); with
        more, later minibatches would see moved weights, so every minibatch gets this rank's rows'
        log-probs under the current weights first (`proximal_logprobs`, one forward pass each)."""
        if len(minibatches) < 2:
            return minibatches
        out = []
        for shard in minibatches:
            batch = shard.columns
            proximal = np.zeros(batch["behaviour_logprobs"].shape, dtype=np.float32)
            for part in self._micro_batches(shard):
                # an empty pass runs a row too: under ZeRO-3 every forward pass gathers the weights from all ranks
                logp = self._policy(sequence_tensors(batch, part if len(part) else np.arange(1)))[0]
                if len(part):
                    proximal[part] = logp.numpy()
            out.append(replace(shard, columns={**batch, "proximal_logprobs": proximal}))
        return out

    def _micro_batches(self, shard: Shard) -> list[np.ndarray]:
        """This rank's rows of a minibatch, cut into `micro_batch_size` passes, as many on every
        rank (ZeRO-2/3 reduce the gradients at each backward; a rank short of rows gets an empty pass)."""
        largest_share = -(-shard.rows // self.world_size)
        count = -(-largest_share // (self.spec.micro_batch_size or largest_share))
        return np.array_split(np.arange(shard.owned), count)

    def _steps_done(self, results: list[dict[str, float]]) -> dict[str, float]:
        """A step's metrics: the mean over its minibatches' updates (skipped ones report none)."""
        self.steps_done += 1
        done = [r for r in results if r["update_success"]] or results
        out = {key: sum(r[key] for r in done) / len(done) for key in done[0]}
        out["update_success"] = sum(r["update_success"] for r in results) / len(results)
        return out

    def _minibatch_step(self, shard: Shard, spec: LossSpec) -> dict[str, float] | None:
        if not shard.tokens:
            return None  # every sample unscored (the same on every rank): no loss, no optimizer step
        batch, my_mask = shard.columns, loss_mask(shard.columns)  # [n, T]: this rank's rows
        # DeepSpeed averages gradients over ranks, so each rank's share is scaled by the world size.
        normalizer = Normalizers(shard.tokens / self.world_size, shard.sequences / self.world_size)
        # Micro-batches, each loss divided by the whole minibatch's counts, so their gradients add
        # up to the minibatch's; DeepSpeed steps once, after the last.
        parts = self._micro_batches(shard)
        tokens = [float(my_mask[part].sum()) for part in parts]
        local: dict[str, float] = {}
        non_finite = False
        for i, part in enumerate(parts):
            # A rank with fewer rows than micro-batches runs a row with no loss (a zero gradient) for each missing one.
            mask = my_mask[part] if len(part) else torch.zeros_like(my_mask[:1])
            total, metrics = self._policy_loss(batch, part if len(part) else np.arange(1), mask, spec, normalizer)
            share = tokens[i] / max(sum(tokens), 1.0)  # the per-token means (clip fraction, ...) are weighted by tokens
            for key, value in metrics.items():
                local[key] = local.get(key, 0.0) + (value if key in ADDITIVE else share * value)
            non_finite |= not torch.isfinite(total)
            if i < len(parts) - 1:
                self.engine.set_gradient_accumulation_boundary(False)
                self.engine.backward(total)
                self.engine.set_gradient_accumulation_boundary(True)
        return self._update(total, local, non_finite, passes=len(parts))

    def _policy_loss(
        self, batch: Mapping[str, np.ndarray], mine: np.ndarray, mask: torch.Tensor, spec: LossSpec, normalizer: Normalizers
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The policy loss of rows `mine` of a minibatch (their `mask`), divided by the whole
        minibatch's `normalizer`, and its metrics."""
        inputs = sequence_tensors(batch, mine)
        logp, full_logp, entropy_per_token = self._policy(inputs, entropy_grad=spec.entropy_coef != 0)  # [n, T] each
        behaviour = torch.from_numpy(batch["behaviour_logprobs"][mine])
        advantages = torch.from_numpy(batch["advantages"][mine]).float()
        base, off_policy = behaviour, {}  # the ratio's base: the policy that sampled, unless decoupled
        if spec.behaviour_weight_cap is not None:
            proximal = torch.from_numpy(batch["proximal_logprobs"][mine]) if "proximal_logprobs" in batch else logp.detach()
            base, advantages, off_policy = decoupled_targets(behaviour, proximal, advantages, mask, spec.behaviour_weight_cap)
        pg_loss, metrics = POLICY_LOSSES.get(spec.policy_loss)(
            logp,
            base,
            advantages,
            mask,
            clip_low=spec.clip_low,
            clip_high=spec.clip_high,
            aggregate=spec.aggregate,
            normalizer=normalizer,
        )
        entropy = masked_aggregate(entropy_per_token, mask, spec.aggregate, normalizer)
        total = pg_loss - spec.entropy_coef * entropy if spec.entropy_coef else pg_loss
        kl_term, kl = torch.zeros(()), torch.zeros(())
        if "reference_logprobs" in batch:
            # Both sides full softmax at the sampling temperature (the reference is never truncated),
            # so the term is 0 (to float rounding) where the policy equals the reference, at any top-k / top-p.
            ref = torch.from_numpy(batch["reference_logprobs"][mine])
            kl_term = masked_aggregate(kl_penalty(full_logp, ref, spec.kl_kind), mask, spec.aggregate, normalizer)
            if spec.kl_coef > 0:
                total = total + spec.kl_coef * kl_term
            with torch.no_grad():  # the value to watch: k3 per token (unbiased for KL(pi || pi_ref) untruncated)
                kl = masked_aggregate(kl_penalty(full_logp, ref, "k3"), mask, "token-mean", normalizer.tokens)
        if spec.poisoned:
            total = total * float("nan")
        metrics = {
            "loss": total.item(),
            "pg_loss": pg_loss.item(),
            "entropy": entropy.item(),
            "kl": kl.item(),
            "kl_loss": kl_term.item(),
            "clip_fraction": metrics["clip_fraction"],
            "approx_kl": metrics["approx_kl"],
            **off_policy,
        }
        return total, metrics

    def _update(
        self, total: torch.Tensor, local: dict[str, float], non_finite: bool = False, passes: int = 1
    ) -> dict[str, float]:
        """One optimizer step on this rank's share `total` of a minibatch's loss (the last of
        `passes` micro-batches', after the others' backward: `non_finite` when any of theirs was); `local`
        are the rank's metrics, each world_size x its share of the minibatch's value (so their mean
        over ranks is it)."""
        skipped = dict.fromkeys([*local, "grad_norm", "lr"], float("nan")) | {"update_success": 0.0}
        # One small all-reduce per minibatch (beside the gradients'): the metrics, and whether any
        # rank's loss is non-finite, which would poison the weights: then every rank skips the update.
        non_finite = non_finite or not torch.isfinite(total)
        summed = self._sum_over_ranks(local | {"non_finite_loss": float(non_finite)})
        if summed.pop("non_finite_loss") > 0:
            if passes > 1 and self.spec.zero_stage >= 2:
                raise FloatingPointError(
                    f"a non-finite loss in an update cut into micro-batches under ZeRO-{self.spec.zero_stage}: the "
                    "earlier micro-batches' gradients are already reduced into DeepSpeed's partitions and cannot be "
                    "dropped, so the update cannot be skipped; lower training.lr, or set training.micro_batch_size=0"
                )
            self.engine.zero_grad()
            return skipped
        lr = self._set_lr()
        self.engine.backward(total)
        with self._clipping() as grad_norm:
            if grad_norm is not None and not math.isfinite(grad_norm):
                self.engine.zero_grad()  # a non-finite gradient: the same skip
                return skipped
            self.engine.step()
        self.optimizer_steps += 1
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()
        # Losses: each rank holds world_size * (its token sum) / (batch tokens), so the mean over
        # ranks is the whole batch's loss. Ratios (clip fraction, approx KL): the mean of the ranks'.
        out = {k: v / self.world_size for k, v in summed.items()}
        out["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        out["lr"] = lr
        out["update_success"] = 1.0
        return out

    def _clipping(self) -> contextlib.AbstractContextManager[float | None]:
        """Yields, without ZeRO, the gradients' global norm, and where raypo clips (`clips_here`)
        the step inside the block clips them to `grad_clip` (`actors.core.clipping.clip_in_step`).
        They are already averaged over ranks here, so the norm read off them is the global one, the
        same on every rank. Under ZeRO, None: DeepSpeed clips and keeps the norm."""
        if self.spec.zero_stage:
            return contextlib.nullcontext(None)
        return clip_in_step(self.optimizer, self.model.parameters(), self.spec.grad_clip if self.clips_here else 0.0)

    def dpo_step(self, minibatches: Iterable[Shard], spec: DPOSpec) -> dict[str, float]:
        """DPO update on a step's preference pairs (`pipelines.data.preferences.encode_pairs` rows
        with `reference_chosen` / `reference_rejected`), one optimizer step per minibatch, of
        which each rank gets its own pairs."""
        self.engine.train()
        return self._steps_done([self._dpo_minibatch_step(mb, spec) for mb in minibatches])

    def _dpo_minibatch_step(self, shard: Shard, spec: DPOSpec) -> dict[str, float]:
        pairs, n, mine = shard.columns, shard.rows, np.arange(shard.owned)
        policy = {side: completion_logprobs(self.engine, pairs, mine, side) for side in COMPLETIONS}  # [n] each
        reference = {side: torch.from_numpy(pairs[f"reference_{side}"][mine]).float() for side in COMPLETIONS}
        # DeepSpeed averages gradients over ranks, so each rank's share is scaled by the world size.
        loss, metrics = dpo_loss(
            policy["chosen"],
            policy["rejected"],
            reference["chosen"],
            reference["rejected"],
            beta=spec.beta,
            kind=spec.kind,
            label_smoothing=spec.label_smoothing,
            normalizer=n / self.world_size,
            nll_coef=spec.nll_coef,
            chosen_tokens=torch.from_numpy(pairs["chosen_mask"][mine].sum(axis=1)).float(),
        )
        return self._update(loss, {"loss": loss.item(), **metrics})

    def rm_step(self, minibatches: Iterable[Shard]) -> dict[str, float]:
        """Bradley-Terry update of a reward model (`head="score"`) on preference pairs
        (`pipelines.data.preferences.encode_reward_pairs` rows), one optimizer step per minibatch,
        of which each rank gets its own pairs."""
        self.engine.train()
        return self._steps_done([self._rm_minibatch_step(mb) for mb in minibatches])

    def _rm_minibatch_step(self, shard: Shard) -> dict[str, float]:
        pairs, n, mine = shard.columns, shard.rows, np.arange(shard.owned)
        chosen, rejected = (completion_scores(self.engine, pairs, mine, side) for side in COMPLETIONS)  # [m] each
        # DeepSpeed averages gradients over ranks, so each rank's share is scaled by the world size.
        loss, metrics = bradley_terry_loss(chosen, rejected, normalizer=n / self.world_size)
        return self._update(loss, {"loss": loss.item(), **metrics})

    @torch.no_grad()
    def pair_scores(self, pairs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`score_chosen`, `score_rejected`: `[N]` reward-model scores of each pair's sequences."""
        self.engine.eval()
        return self._in_chunks(
            len(pairs["chosen_input_ids"]), "score", lambda rows, side: completion_scores(self.engine, pairs, rows, side)
        )

    @torch.no_grad()
    def pair_logprobs(self, pairs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`policy_chosen`, `policy_rejected`: `[N]` summed log-probs of each pair's completions
        under the current weights (all pairs)."""
        self.engine.eval()
        return self._in_chunks(
            len(pairs["prompt_ids"]), "policy", lambda rows, side: completion_logprobs(self.engine, pairs, rows, side)
        )

    @staticmethod
    def _in_chunks(n: int, prefix: str, per_side, chunk: int = EVAL_CHUNK) -> dict[str, np.ndarray]:
        """`per_side(rows, side) -> [len(rows)]` over all `n` pairs, `chunk` rows at a time (an
        evaluation set at once would hold `[N, L, V]` logits), as `<prefix>_<side>` arrays."""
        chunks = [np.arange(start, min(n, start + chunk)) for start in range(0, n, chunk)]
        return {f"{prefix}_{side}": torch.cat([per_side(rows, side) for rows in chunks]).numpy() for side in COMPLETIONS}

    def _set_lr(self) -> float:
        """The next optimizer step's learning rate (warmup, times the rollbacks' scale), set and returned."""
        warmup = min(1.0, (self.optimizer_steps + 1) / self.spec.warmup_steps) if self.spec.warmup_steps else 1.0
        lr = self.spec.lr * warmup * self.lr_scale
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def set_lr_scale(self, scale: float) -> None:
        """Scale the learning rate from the next update on (the driver lowers it after a rollback)."""
        self.lr_scale = scale

    def _sum_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        if self.world_size == 1:
            return values
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist(), strict=True))

    @contextlib.contextmanager
    def _full_weights(self):
        """The model's full state dict (gathered from all ranks under ZeRO-3: every rank must enter)."""
        gather = contextlib.nullcontext()
        if self.spec.zero_stage == 3:
            import deepspeed  # heavy: only a learner process loads it

            gather = deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)
        with gather, torch.no_grad():
            yield self.model.state_dict()

    def state_dict(self, copy: bool = True) -> dict[str, np.ndarray]:
        """Full weights as numpy, Hugging Face names, on rank 0; {} on the other ranks, which
        only take part (a ZeRO-3 gather needs every rank). `copy=False` returns views of float32
        weights for a caller that serializes them before the next update (a Ray call's return
        value is copied into the object store as the call returns); under ZeRO-3 the gathered
        weights are released when the gather ends, so they are always copied."""
        with self._full_weights() as state:
            if self.rank != 0:
                return {}
            arrays = {k: v.detach().float().numpy() for k, v in state.items()}  # views of float32 weights
            return {k: a.copy() for k, a in arrays.items()} if copy or self.spec.zero_stage == 3 else arrays

    def weights_nbytes(self, as_float32: bool) -> int:
        """The bytes of the full weights, as float32 (what the object-store sync sends) or in the
        model's dtypes (a broadcast). Every rank takes part (a ZeRO-3 gather needs every rank)."""
        with self._full_weights() as state:
            return sum(v.numel() * (4 if as_float32 else v.element_size()) for v in state.values())

    def open_weight_sync(self, host: str, port: int, world_size: int, backend: str):
        """Rank 0 hosts the weight-sync group (see actors/core/weight_sync.py); returns its layout."""
        with self._full_weights() as state:
            layout = layout_of(state)
        if self.rank == 0:
            self.sync_group = open_group(host, port, 0, world_size, backend)
        return layout

    def broadcast_weights(self) -> None:
        """Every rank takes part (ZeRO-3 gathers the full weights); rank 0 sends them."""
        with self._full_weights() as state:
            if self.rank == 0:
                send(self.sync_group, state)

    def save_checkpoint(self, out_dir: str | Path) -> None:
        """Policy in Hugging Face format under `policy/`, optimizer and step state under
        `deepspeed/` (every rank takes part)."""
        out_dir = Path(out_dir)
        self.engine.save_checkpoint(
            str(out_dir / "deepspeed"),
            tag="state",
            client_state={"steps_done": self.steps_done, "optimizer_steps": self.optimizer_steps},
        )
        self.save_pretrained(out_dir / "policy")

    def load_checkpoint(self, out_dir: str | Path) -> None:
        path, client = self.engine.load_checkpoint(str(Path(out_dir) / "deepspeed"), tag="state")
        if path is None:
            raise FileNotFoundError(f"no learner state in {out_dir}")
        self.steps_done = client["steps_done"]
        self.optimizer_steps = client.get("optimizer_steps", 0)

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Hugging Face format (safetensors + tokenizer), written by rank 0."""
        state = self.state_dict(copy=False)  # written out before the weights move again
        if self.rank != 0:
            return
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {k: torch.from_numpy(v) for k, v in state.items()}
        self.model.save_pretrained(out_dir, state_dict=tensors, safe_serialization=True)
        AutoTokenizer.from_pretrained(self.tokenizer_dir).save_pretrained(out_dir)


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | list:
    """The model's longest ModuleList: a Hugging Face causal LM's decoder layers."""
    return max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len, default=[])


def _load_model(spec: LearnerSpec):
    """The model a learner trains, in float32 (DeepSpeed's bf16 mode casts it)."""
    if spec.head == "lm":
        return AutoModelForCausalLM.from_pretrained(spec.model_dir, dtype=torch.float32)
    if spec.head == "score":
        # The score is read at the last token that is not padding, which the model finds by the pad id.
        pad = pad_id(AutoTokenizer.from_pretrained(spec.model_dir))
        return AutoModelForSequenceClassification.from_pretrained(
            spec.model_dir, num_labels=1, pad_token_id=pad, dtype=torch.float32
        )
    raise ValueError(f"unknown learner head {spec.head!r}; known: lm, score")

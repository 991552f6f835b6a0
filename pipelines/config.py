"""One typed config tree for raypo: pydantic v2 models, frozen after load.

Read from a YAML file with dotted overrides (`--set algo.clip_eps=0.1`). Unknown keys and bad
values fail with a `ConfigError` naming the dotted key, and so do combinations that cannot run
(`algo.name=ppo` with `algo.advantage=grpo`), naming both keys. The seeds' own `config.yaml` shape
(`training.group_size`, `training.gamma`, `training.clip_range`, `resource.cpu_affinity:
[0-15]`) loads as-is: those training keys are read into `algo`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator


class ConfigError(ValueError):
    """A config file or override that cannot be loaded; the message names the key."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _empty_is_none(cls, data):
        """`key: ""` reads as `key:` (null) wherever the field may be empty (the descriptions' `empty = ...`)."""
        if not isinstance(data, dict):
            return data
        return {
            k: None if v == "" and k in cls.model_fields and _may_be_none(cls.model_fields[k].annotation) else v
            for k, v in data.items()
        }


def _may_be_none(annotation) -> bool:
    return type(None) in get_args(annotation)


# ----------------------------------------------------------------------------- tasks
class ArithmeticTaskConfig(Strict):
    name: Literal["arithmetic"] = "arithmetic"
    min_operand: int = Field(0, ge=0, description="smallest operand")
    max_operand: int = Field(99, ge=0, description="largest operand")
    operators: str = Field("+", description="operators to draw from, any of '+-*'")


class ReverseTaskConfig(Strict):
    name: Literal["reverse"] = "reverse"
    min_length: int = Field(2, ge=1, description="shortest string to reverse")
    max_length: int = Field(5, ge=1, description="longest string to reverse")
    alphabet: str = Field("abcdefghij", description="characters the strings are made of")


TaskConfig = Annotated[ArithmeticTaskConfig | ReverseTaskConfig, Field(discriminator="name")]


# ----------------------------------------------------------------------------- model
class WarmStartBand(Strict):
    """Where a warm start must land for RL to show learning, checked after the SFT on held-out
    problems other than the reported ones: greedy accuracy low enough to leave room, sampling
    accuracy high enough that RL's samples hold right answers to reward. Outside it, the SFT
    goes on (more rounds), then starts over from another initialisation, then fails."""

    problems: int = Field(500, ge=50, description="held-out check problems (disjoint from the reported ones)")
    samples: int = Field(4, ge=1, description="samples per check problem for the sampling accuracy")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the check (the RL presets sample at 1.0)")
    min_greedy: float = Field(0.2, ge=0, le=1, description="lowest greedy accuracy: below it the model has not learned the task")
    max_greedy: float = Field(0.6, ge=0, le=1, description="highest greedy accuracy: above it RL has too little room")
    min_sampled: float = Field(0.5, ge=0, le=1, description="lowest sampling accuracy: below it RL finds too few right answers")
    extra_rounds: int = Field(3, ge=0, description="further SFT rounds when the check fails")
    extra_round_steps: int = Field(500, ge=1, description="steps of each further round (at half the peak learning rate)")
    attempts: int = Field(2, ge=1, description="fresh initialisations to try before the build fails")

    @model_validator(mode="after")
    def _ordered(self):
        if self.min_greedy > self.max_greedy:
            raise ValueError(f"min_greedy {self.min_greedy} is above max_greedy {self.max_greedy}")
        return self


class TinyModelConfig(Strict):
    """Shape and warm start of the embedded tiny model (`raypo make-tiny`)."""

    seed: int = Field(0, description="seed of the initial weights, SFT data and order")
    hidden_size: int = Field(128, ge=32, description="model width; head size = hidden / heads")
    intermediate_size: int = Field(384, ge=32, description="MLP width")
    num_layers: int = Field(4, ge=1, description="transformer blocks")
    num_heads: int = Field(4, ge=1, description="attention heads; head size must suit vLLM's CPU backend (32, 64, ...)")
    max_positions: int = Field(128, ge=16, description="context length in characters")
    sft_tasks: list[TaskConfig] = Field(
        default_factory=lambda: [ArithmeticTaskConfig()],
        description="tasks the warm start trains on; the first one is the one accuracy is reported for",
    )
    sft_problems: int = Field(7000, ge=1, description="distinct train problems per task")
    sft_slip_share: float = Field(
        0.6, ge=0, le=1, description="share of SFT answers replaced by the task's systematic slip (arithmetic: carries dropped)"
    )
    sft_steps: int = Field(3000, ge=0, description="optimizer steps of the warm start's first round")
    sft_batch_size: int = Field(64, ge=1, description="sequences per SFT step")
    sft_lr: float = Field(1e-3, gt=0, description="peak learning rate of the warm start (cosine decay)")
    heldout_problems: int = Field(500, ge=1, description="held-out problems the reported accuracy is measured on")
    band: WarmStartBand = Field(default_factory=WarmStartBand, description="where the warm start must land (checked)")

    @model_validator(mode="after")
    def _heads_divide_width(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        return self


class ModelConfig(Strict):
    path: str | None = Field(None, description="Hugging Face causal LM directory; empty = the embedded tiny model")
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="the embedded model, used when path is empty")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="weights dtype: the learner trains in bf16 mode at bfloat16, else in float32; the engines take it "
        "unless inference.dtype names their own",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="recompute activations in backward to save memory (the learner then runs each row's "
        "prompt with its response: no packing, README 'Prompt and responses in one packed row')",
    )


PathSpec = str | list[str]


class DatasetConfig(Strict):
    """The user's own prompts: JSON Lines, JSON, CSV or Parquet files (a path, a glob or a list),
    a directory of such files (splits from the file names, as Hugging Face `datasets` infers
    them), or a directory written by `Dataset.save_to_disk`. Every column other than the prompt
    reaches the reward functions per sample, by its name (and the answer column also as `answer`)."""

    path: PathSpec = Field(description="train data: a file, a glob, a list of them, or a directory")
    heldout_path: PathSpec | None = Field(None, description="held-out data in its own file(s); empty = see heldout_split")
    heldout_split: str | None = Field(
        None, description="the dataset's own held-out split (e.g. test); empty = a 'test' or 'validation' split if there is one"
    )
    heldout_percent: int = Field(
        20, ge=0, le=90, description="without a held-out file or split: this share of prompts, chosen by a hash of the prompt"
    )
    train_split: str = Field("train", description="the split to train on, in a directory or save_to_disk dataset")
    prompt_key: str = Field("prompt", description="column of the prompt: a string, or chat messages [{role, content}, ...]")
    answer_key: str | None = Field(
        "answer", description="column of the reference answer (passed to rewards as `answer`); empty = none"
    )
    apply_chat_template: bool | None = Field(
        None, description="render prompts with the model's chat template; empty = chat messages yes, plain strings no"
    )
    chat_template: str | None = Field(None, description="a Jinja chat template to use instead of the tokenizer's own")
    max_prompt_tokens: int = Field(512, ge=1, description="longer prompts (after the template) are dropped and counted")
    max_bad_fraction: float = Field(
        0.0, ge=0, lt=1, description="share of malformed rows tolerated (skipped, reported); above it the run stops at load"
    )
    chosen_key: str = Field("chosen", description="DPO: column of the preferred completion (a string or chat messages)")
    rejected_key: str = Field("rejected", description="DPO: column of the dispreferred completion (a string or chat messages)")


class TaskSection(Strict):
    task: TaskConfig = Field(default_factory=ArithmeticTaskConfig, description="the built-in verifiable task RL trains on")
    dataset: DatasetConfig | None = Field(None, description="your own prompts instead of a built-in task")
    eval_problems: int = Field(500, ge=1, description="held-out problems evaluated before/after training (at most)")

    @model_validator(mode="after")
    def _one_source(self):
        if self.dataset is not None and "task" in self.model_fields_set:
            raise ValueError("task.task and task.dataset are both set: train on a built-in task or on your dataset, not both")
        return self


class EvalConfig(Strict):
    """Evaluation on the held-out split: before and after training, every `every` steps, and
    by `raypo eval`. A sample passes when its combined reward (before normalising) reaches
    `pass_threshold`."""

    every: int = Field(0, ge=0, description="evaluate every N steps beside the next step (0 = only before and after)")
    pass_threshold: float | None = Field(
        None, description="combined reward that counts as a pass; empty = reward.value_range's top"
    )
    samples: int = Field(4, ge=0, description="k of pass@k: sampled completions per held-out prompt (0 = greedy only)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature for pass@k")
    max_tokens: int | None = Field(
        None, ge=1, description="longest completion; empty = inference.max_tokens (built-in tasks: answer + 2)"
    )


# ----------------------------------------------------------------------------- reward
class RewardTerm(Strict):
    fn: str = Field("exact_match", description="a built-in reward name or path/to/file.py:function")
    weight: float = Field(1.0, description="weight of this term in the combined reward")


class RewardConfig(Strict):
    terms: list[RewardTerm] = Field(default_factory=lambda: [RewardTerm()], min_length=1, description="rewards to combine")
    normalize: bool = Field(True, description="scale combined rewards from value_range to [-1, 1] (the seeds' advice)")
    value_range: tuple[float, float] = Field((0.0, 1.0), description="range of the combined reward before normalising")
    refresh_every: int = Field(
        0, ge=0, description="retrain the model: reward term every N policy updates on pairs from recent samples (0 = never)"
    )
    refresh_labels: str = Field(
        "exact_match", description="the rule reward that labels recent samples for a refresh (it stands in for new human labels)"
    )
    refresh_steps: int = Field(50, ge=1, description="optimizer steps of each refresh (Adam, L2 at rm.l2_coef)")
    refresh_lr: float = Field(1e-4, gt=0, description="learning rate of each refresh")

    @field_validator("value_range")
    @classmethod
    def _ordered(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not value[0] < value[1]:
            raise ValueError(f"value_range must be [low, high] with low < high, got {list(value)}")
        return value

    @model_validator(mode="after")
    def _refresh_needs_a_model(self):
        models = [t.fn for t in self.terms if t.fn.startswith("model:")]
        if self.refresh_every and len(models) != 1:
            raise ValueError(f"reward.refresh_every needs exactly one model: reward term to refresh, got {len(models)}")
        return self


# ----------------------------------------------------------------------------- algorithm
AggregateMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]

# What each algorithm sets when the config leaves it out; `AlgoConfig._fits_the_algorithm` checks what it sets.
ALGORITHM_DEFAULTS: dict[str, dict[str, str]] = {
    "grpo": {"advantage": "grpo", "policy_loss": "ppo"},
    "gspo": {"advantage": "grpo", "policy_loss": "gspo"},  # GRPO's pipeline with GSPO's sequence-level ratio
    "ppo": {"advantage": "gae", "policy_loss": "ppo"},
}


class AlgoConfig(Strict):
    name: Literal["grpo", "ppo", "gspo", "dpo"] = Field(
        "grpo", description="the algorithm to run; it sets advantage and policy_loss when they are left out"
    )
    advantage: str = Field(
        "grpo", description="advantage estimator: gae (ppo), grpo, dr_grpo, rloo, reinforce_baseline (grpo, gspo)"
    )
    policy_loss: str = Field("ppo", description="policy loss: ppo (token ratio) or gspo (sequence ratio; algo.name=gspo)")
    aggregate: AggregateMode = Field("token-mean", description="loss reduction over tokens and sequences")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO clip range (lower side)")
    clip_eps_high: float | None = Field(None, gt=0, description="upper clip range; empty = clip_eps")
    clip_decay: float = Field(0.05, ge=0, lt=1, description="clip range decays by this share ...")
    clip_decay_every: int = Field(1000, ge=1, description="... every this many steps")
    gamma: float = Field(0.99, ge=0, le=1, description="discount")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda reached after the ramp")
    lam_start: float = Field(0.9, ge=0, le=1, description="GAE lambda at step 0")
    lam_ramp_steps: int = Field(1000, ge=0, description="steps over which lambda goes from lam_start to lam")
    group_size: int = Field(8, ge=1, description="samples per prompt (GRPO group)")
    group_growth: float = Field(0.0, ge=0, description="group size grows by this share per round (seeds: 0.10)")
    group_size_max: int | None = Field(None, ge=1, description="cap on the grown group size")
    group_growth_every: int = Field(100, ge=1, description="steps per round of group-size growth")
    value_clip: float = Field(0.5, gt=0, description="value clip range")
    entropy_coef: float = Field(0.01, ge=0, description="weight of the entropy bonus")
    kl_coef: float = Field(0.001, ge=0, description="weight of the KL penalty to the reference model")
    kl_kind: Literal["k1", "k2", "k3"] = Field(
        "k2",
        description="KL estimator in the loss: k2 = (log pi/pi_ref)^2 / 2, whose gradient is that of KL(pi || pi_ref); "
        "k3 = r - 1 - log r (r = pi_ref/pi), whose gradient is that of KL(pi_ref || pi); k1 = log pi/pi_ref has zero "
        "expected gradient as a loss and is refused with a KL penalty on",
    )
    off_policy_steps: int = Field(
        0,
        ge=0,
        le=8,
        description="rollout runs this many steps ahead of learning: while the learners train on step t's batch, the "
        "engines already sample step t+1's, from weights this many updates old; the loss then corrects for the staleness "
        "(decoupled PPO). 0 = synchronous: each step samples from the newest weights",
    )
    off_policy_weight_cap: float = Field(
        2.0,
        ge=1,
        description="with off_policy_steps > 0: each token's importance weight pi_proximal / pi_behaviour (the policy "
        "the loss is clipped around over the stale one that sampled it) is truncated at this",
    )
    dpo_beta: float = Field(0.1, gt=0, description="DPO temperature")
    dpo_kind: Literal["sigmoid", "ipo"] = Field("sigmoid", description="DPO loss form")
    dpo_label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="conservative DPO smoothing")
    dpo_nll_coef: float = Field(
        0.0, ge=0, description="weight of the chosen completions' NLL per token beside the DPO loss (RPO; TRL's rpo_alpha)"
    )

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        name = data.get("name", "grpo")
        return {**ALGORITHM_DEFAULTS.get(name if isinstance(name, str) else "", {}), **data}  # a bad name: refused below

    @field_validator("advantage", "policy_loss")
    @classmethod
    def _registered(cls, name: str, info: ValidationInfo) -> str:
        # Here, not at the top: the registries live with torch code, and loading a config
        # (`raypo --help`, `raypo show-config`) should not import torch unless it validates one.
        from pipelines.algos.advantages import ADVANTAGES
        from pipelines.algos.losses import POLICY_LOSSES

        registry = ADVANTAGES if info.field_name == "advantage" else POLICY_LOSSES
        try:
            registry.get(name)
        except KeyError as err:
            raise ValueError(err.args[0]) from None
        return name

    @model_validator(mode="after")
    def _fits_the_algorithm(self):
        pair = f"algo.name={self.name} with algo.advantage={self.advantage}"
        if self.name == "dpo" and self.advantage == "gae":
            raise ValueError(f"{pair}: DPO learns from preference pairs, with no critic; leave algo.advantage out")
        if self.name == "ppo" and self.advantage != "gae":
            raise ValueError(f"{pair}: PPO trains a critic for GAE advantages; use algo.advantage=gae, or algo.name=grpo")
        if self.name in ("grpo", "gspo") and self.advantage == "gae":
            raise ValueError(f"{pair}: {self.name} has no critic, and GAE needs one; use algo.name=ppo, or a group advantage")
        if self.name == "gspo" and self.policy_loss != "gspo":
            raise ValueError(
                f"algo.name=gspo with algo.policy_loss={self.policy_loss}: GSPO is GRPO with the gspo policy loss; "
                "leave algo.policy_loss out, or use algo.name=grpo"
            )
        return self

    @model_validator(mode="after")
    def _off_policy_needs_sampling(self):
        if self.name == "dpo" and self.off_policy_steps:
            raise ValueError(
                f"algo.off_policy_steps={self.off_policy_steps} with algo.name=dpo: DPO samples nothing, so there is no "
                "rollout to run ahead of learning; leave algo.off_policy_steps at 0"
            )
        return self

    @model_validator(mode="after")
    def _kl_estimator_has_a_gradient(self):
        if self.kl_coef > 0 and self.kl_kind == "k1" and self.name != "dpo":
            raise ValueError(
                f"algo.kl_kind=k1 with algo.kl_coef={self.kl_coef:g}: as a loss term k1 = log pi - log pi_ref has zero "
                "expected gradient on samples of pi (E[grad log pi] = 0), so the penalty would do nothing; use k2 "
                "(gradient of KL(pi || pi_ref)) or k3 (gradient of KL(pi_ref || pi)), or algo.kl_coef=0"
            )
        return self

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @property
    def uses_critic(self) -> bool:
        """Whether the run trains a value model (PPO's GAE advantages need one)."""
        return self.advantage == "gae"

    @property
    def uses_reference(self) -> bool:
        """Whether the run needs the frozen reference model: DPO's loss, or a KL penalty."""
        return self.name == "dpo" or self.kl_coef > 0

    @property
    def generates(self) -> bool:
        """Whether the run samples completions (RL) rather than learning from given pairs (DPO)."""
        return self.name != "dpo"


class RewardModelConfig(Strict):
    """`raypo train-rm`: a Bradley-Terry reward model (a one-logit sequence-classification head on
    the policy's architecture) trained on the preference pairs of `task` with `training`'s
    batch sizes, steps and learning rate; saved to <output_dir>/<name>/reward_model."""

    l2_coef: float = Field(1e-4, ge=0, description="L2 regularisation of the weights (the seeds' 1e-4 against RM overfitting)")
    min_tau: float = Field(0.7, ge=-1, le=1, description="held-out Kendall tau the RM should reach (the seeds' target)")


# ----------------------------------------------------------------------------- training, inference, resources
class TrainingConfig(Strict):
    batch_size: int = Field(128, ge=1, description="samples (prompts x group) per RL step")
    steps: int = Field(100, ge=0, description="RL steps")
    lr: float = Field(3e-5, gt=0, description="learning rate")
    warmup_steps: int = Field(10, ge=0, description="optimizer steps of linear learning-rate warmup")
    grad_clip: float = Field(1.0, gt=0, description="max gradient norm")
    minibatch_size: int = Field(
        64, ge=1, description="most samples per optimizer step (a step's rows are cut into equal minibatches of at most this)"
    )
    epochs: int = Field(1, ge=1, description="passes over each step's experience")
    micro_batch_size: int = Field(
        0,
        ge=0,
        description="most rows one learner runs forward and backward at once: its share of a minibatch is cut into "
        "micro-batches whose gradients add up to one optimizer step, so memory does not grow with the minibatch "
        "(0 = its whole share at once). Policy updates only",
    )
    save_every: int = Field(50, ge=0, description="checkpoint every N steps (0 = only at the end)")
    keep_checkpoints: int = Field(3, ge=0, description="keep the newest N checkpoints, deleting older ones (0 = keep all)")
    rollback_after: int = Field(
        5,
        ge=0,
        description="after this many steps in a row whose update failed (non-finite loss or gradient), roll the "
        "learners and engines back to the last good checkpoint (0 = never)",
    )
    rollback_lr_factor: float = Field(0.5, gt=0, le=1, description="multiply the learning rate by this at each rollback")
    spill_experience: bool = Field(False, description="write each step's experience to runs/<name>/experience/*.parquet")
    spill_max_gb: float = Field(1.0, ge=0, description="spilled experience kept: the oldest files go past this (0 = no limit)")
    spill_max_age_hours: float = Field(168, ge=0, description="spilled experience older than this is deleted (0 = kept)")
    storage_path: str | None = Field(
        None,
        description="where the run's checkpoints, final/ policy, metrics and summary go: a directory every node can "
        "reach, or a URI pyarrow's filesystems take (s3://bucket/runs, gs://..., file:///shared/runs); the run is "
        "<storage_path>/<name>. Empty = <output_dir>/<name> as an absolute path on the driver's machine",
    )


class InferenceConfig(Strict):
    max_tokens: int = Field(2048, ge=1, description="longest completion")
    temperature: float = Field(0.7, ge=0, description="sampling temperature (RL needs > 0)")
    top_p: float = Field(0.9, gt=0, le=1, description="nucleus sampling: keep the most likely tokens up to this mass (1 = off)")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens before top_p (0 = off)")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="the vLLM engines' weights dtype (the rollout engines, the run's evaluations on them, raypo eval); "
        "empty = model.dtype. bfloat16 under a float32 learner: the engines sample from the policy's weights rounded to "
        "bf16, and the loss takes its ratio to the log-probs they sampled with; on CPUs with AMX (Intel Xeon, 4th "
        "generation on) that samples SmolLM2 about 2x faster (README, 'Sampling in bfloat16')",
    )


# A node of cluster.yaml's type T advertises this resource (`raypo_node:learner: 1000`); a
# bundle that asks for a sliver of it can only be placed on such a node.
NODE_TYPE_RESOURCE = "raypo_node:"
NODE_TYPE_SHARE = 0.001


def node_type_of(resources: dict[str, float]) -> str | None:
    """The cluster.yaml node type a bundle (or a node's resources) names, if any.

    >>> node_type_of({"CPU": 1.0, "raypo_node:learner": 0.001}), node_type_of({"CPU": 1.0})
    ('learner', None)
    """
    return next((key[len(NODE_TYPE_RESOURCE) :] for key in resources if key.startswith(NODE_TYPE_RESOURCE)), None)


def node_kind(resources: dict[str, float]) -> str | None:
    """A Ray node's cluster.yaml type from its resources, `head` for the head node, else None.

    >>> node_kind({"CPU": 1.0, "raypo_node:rollout": 1000.0}), node_kind({"node:__internal_head__": 1.0}), node_kind({})
    ('rollout', 'head', None)
    """
    return node_type_of(resources) or ("head" if "node:__internal_head__" in resources else None)


# The roles of a run that take a placement bundle, and the cluster.yaml node type each goes on by
# default: the models that train on learner nodes, the ones that only run forward on rollout nodes.
PLACED_ROLES = ("learner", "rollout", "reference", "value", "reward", "buffer", "helpers")
DEFAULT_NODE_TYPES = {"learner": "learner", "value": "learner", "rollout": "rollout", "reference": "rollout"}


class ResourceConfig(Strict):
    gpu_memory_fraction: float = Field(0.8, gt=0, le=1, description="share of accelerator memory vLLM may take")
    cpu_affinity: list[int] = Field(
        default_factory=list,
        description="CPU cores the driver, and the local Ray it starts, run on (empty = all); ranges such as [0-15]",
    )
    use_gpu: bool = Field(False, description="place learners/rollout on GPUs")
    num_rollout_workers: int = Field(1, ge=1, description="rollout actors (vLLM engines)")
    num_learners: int = Field(1, ge=1, description="learner actors in one torch.distributed world")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage")
    cpus_per_learner: float = Field(1.0, gt=0, description="CPUs in each learner's placement bundle")
    accelerator_type: str | None = Field(None, description="e.g. A100: pins learners to such nodes")
    node_types: dict[str, str] = Field(
        default_factory=lambda: dict(DEFAULT_NODE_TYPES),
        description="the cluster.yaml node type each role is placed on (roles: " + ", ".join(PLACED_ROLES) + "); a "
        "node of type T advertises the resource raypo_node:T. Used when the cluster's nodes advertise such resources; "
        "on one machine, or for a role not named here, the role goes on any node with room",
    )
    placement: Literal["auto", "node_types", "anywhere"] = Field(
        "auto",
        description="pin roles to their resource.node_types: auto = when the cluster's nodes advertise raypo_node:<type> "
        "now; node_types = always (the autoscaler adds nodes of those types, e.g. cluster.yaml's min_workers: 0); "
        "anywhere = never",
    )
    placement_timeout_s: float = Field(
        600, gt=0, description="how long a run waits for the cluster (and its autoscaler) to place all its roles"
    )
    weight_sync: Literal["auto", "object_store", "broadcast"] = Field(
        "auto",
        description="how new weights reach the rollout engines: object_store (learner -> Ray object store -> engines), "
        "broadcast (a collective from learner rank 0: NCCL on GPUs, gloo on CPU); auto = broadcast on GPUs",
    )
    max_actor_restarts: int = Field(
        3,
        ge=0,
        description="times Ray restarts each rollout, reward, reference, value, buffer and helper actor whose process dies "
        "(the driver re-issues the lost work of the step); past it the run stops (0 = a dead actor stops the run)",
    )

    @field_validator("cpu_affinity", mode="before")
    @classmethod
    def _parse_ranges(cls, value: Any) -> list[int]:
        return parse_cpu_list(value)

    @field_validator("node_types")
    @classmethod
    def _known_roles(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(value) - set(PLACED_ROLES))
        if unknown:
            raise ValueError(f"unknown role(s) {unknown}; roles are {', '.join(PLACED_ROLES)}")
        return value


def parse_cpu_list(value: Any) -> list[int]:
    """`[0-3, 8]`, `"0-3,8"` or `[0, 1]` -> sorted unique core ids.

    >>> parse_cpu_list(["0-3", 8]), parse_cpu_list("2,0-1")
    ([0, 1, 2, 3, 8], [0, 1, 2])
    """
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, str | list | tuple):
        raise ValueError(f"must be a list of CPU ids or ranges such as [0-3, 8], got {type(value).__name__}")
    items = value.split(",") if isinstance(value, str) else list(value)
    cores: set[int] = set()
    for item in items:
        if isinstance(item, bool):
            raise ValueError(f"CPU id must be an integer or a range 'a-b', got {item!r}")
        if isinstance(item, int):
            cores.add(item)
            continue
        text = str(item).strip()
        lo, sep, hi = text.partition("-")
        if not (lo.isdigit() and (not sep or hi.isdigit())) or (sep and int(hi) < int(lo)):
            raise ValueError(f"CPU id must be an integer or a range 'a-b', got {item!r}")
        cores.update(range(int(lo), int(hi if sep else lo) + 1))
    return sorted(cores)


class MonitorConfig(Strict):
    grad_norm_alert: float = Field(1.5, gt=0, description="warn when the grad norm exceeds this")
    kl_alert: float = Field(0.02, gt=0, description="warn when KL to the reference exceeds this")
    reward_drop: float = Field(0.10, gt=0, description="warn when reward falls by more than this share ...")
    reward_drop_steps: int = Field(5, ge=1, description="... on this many consecutive steps")
    reward_window: int = Field(100, ge=1, description="steps in the reward trend window")
    print_every: int = Field(10, ge=1, description="print each kind of alert at most once per this many steps")
    update_success_alert: float = Field(
        0.999, ge=0, le=1, description="warn when the run's share of updates that succeeded falls below this"
    )


class ChaosConfig(Strict):
    """Fault injection, for testing that a run survives its failures (bench/chaos.py); off by default."""

    nan_loss_steps: list[int] = Field([], description="the updates of these steps get a NaN loss, as a diverged model's would")


# ----------------------------------------------------------------------------- root
# Keys of the seeds' config.yaml that live under `training` there and under `algo` here.
_SEED_TRAINING_KEYS = {"group_size": "group_size", "gamma": "gamma", "clip_range": "clip_eps"}


class RaypoConfig(Strict):
    name: str = Field("raypo", description="run name; outputs go to <output_dir>/<name>")
    seed: int = Field(0, description="global seed")
    output_dir: str = Field("runs", description="where runs are written")
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskSection = Field(default_factory=TaskSection)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    resource: ResourceConfig = Field(default_factory=ResourceConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    rm: RewardModelConfig = Field(default_factory=RewardModelConfig)
    chaos: ChaosConfig = Field(default_factory=ChaosConfig, description="fault injection for recovery tests (off)")

    @model_validator(mode="after")
    def _rl_samples(self):
        if self.algo.generates and self.inference.temperature == 0:
            raise ValueError(
                f"inference.temperature=0 with algo.name={self.algo.name}: greedy decoding gives every sample of a prompt "
                "the same completion, so there is nothing to compare and the policy's log-probs are undefined; use a "
                "temperature > 0"
            )
        return self

    @model_validator(mode="after")
    def _refresh_needs_samples(self):
        if self.reward.refresh_every and not self.algo.generates:
            raise ValueError(f"reward.refresh_every with algo.name={self.algo.name}: a refresh learns from sampled completions")
        return self

    @property
    def engine_dtype(self) -> str:
        """The vLLM engines' weights dtype: `inference.dtype`, else `model.dtype`."""
        return self.inference.dtype or self.model.dtype

    @property
    def pass_threshold(self) -> float:
        """The combined reward at which an evaluated sample counts as passed."""
        return self.reward.value_range[1] if self.eval.pass_threshold is None else self.eval.pass_threshold

    @model_validator(mode="before")
    @classmethod
    def _read_seed_training_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("training"), dict):
            return data
        training = dict(data["training"])
        algo = dict(data.get("algo") or {})
        for seed_key, algo_key in _SEED_TRAINING_KEYS.items():
            if seed_key not in training:
                continue
            value = training.pop(seed_key)
            if algo_key in algo and algo[algo_key] != value:
                raise ValueError(f"training.{seed_key}={value!r} conflicts with algo.{algo_key}={algo[algo_key]!r}; set one")
            algo[algo_key] = value
        return {**data, "training": training, "algo": algo}


# ----------------------------------------------------------------------------- loading
def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RaypoConfig:
    """Defaults, then the YAML file at `path`, then `key.sub=value` overrides (values in YAML)."""
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_yaml(Path(path))
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {override!r} is not of the form key.sub=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as err:
            raise ConfigError(f"override {key}: value {raw!r} is not valid YAML ({err})") from None
        set_dotted(data, key.strip(), value)
    return config_from_dict(data, source=str(path) if path else "overrides")


def config_from_dict(data: dict[str, Any], source: str = "config") -> RaypoConfig:
    try:
        return RaypoConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"invalid config ({source}):\n" + _describe(err)) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top, got {type(data).__name__}")
    return data


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        # Drop pydantic's union-tag segments (e.g. 'arithmetic') so the key reads as in YAML.
        loc = ".".join(str(p) for p in e["loc"] if p not in ("arithmetic", "reverse")) or "(root)"
        message = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            message = "unknown key"
        lines.append(f"  {loc}: {message}")
    return "\n".join(lines)

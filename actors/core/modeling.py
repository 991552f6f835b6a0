"""What every role that runs the policy model shares: its inputs and its response logits.

The learner, the reference scorer and the critic all feed a rollout batch's prompt + response
through a causal LM the same way; this module is that one way, so none depends on another.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping

import numpy as np
import torch

from actors.core.minibatch import scored_tokens
from pipelines.algos.losses import logprobs_from_logits


def sequence_tensors(batch: Mapping[str, np.ndarray], rows: np.ndarray) -> dict[str, torch.Tensor]:
    """Model inputs for `rows` of a batch: prompt (left-padded) + response (right-padded).

    input_ids, attention_mask, position_ids: `[n, P + T]`; response_ids, response_mask: `[n, T]`.
    Positions count real tokens only, so a left-padded prompt starts at position 0 as in vLLM.

    >>> batch = {"prompt_ids": np.array([[0, 5, 6]]), "prompt_mask": np.array([[0, 1, 1]]),
    ...          "response_ids": np.array([[7, 0]]), "response_mask": np.array([[1, 0]])}
    >>> inputs = sequence_tensors(batch, np.arange(1))
    >>> inputs["input_ids"].tolist(), inputs["position_ids"].tolist()
    ([[0, 5, 6, 7, 0]], [[0, 0, 1, 2, 2]])
    """
    prompt_ids = torch.from_numpy(batch["prompt_ids"][rows])
    prompt_mask = torch.from_numpy(batch["prompt_mask"][rows])
    response_ids = torch.from_numpy(batch["response_ids"][rows])
    response_mask = torch.from_numpy(batch["response_mask"][rows])
    attention = torch.cat([prompt_mask, response_mask], dim=1)  # [n, P + T]
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    return {
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention,
        "position_ids": positions,
        "response_ids": response_ids,
        "response_mask": response_mask,
    }


def loss_mask(batch: Mapping[str, np.ndarray]) -> torch.Tensor:
    """`[N, T]`: the response tokens of the samples a reward scored (`scored` `[N]`; all when the
    batch has no such column). Unscored samples stay out of every loss and normalizer."""
    return torch.from_numpy(scored_tokens(batch))


def response_logits(model, inputs: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """Logits that predict each response token, `[n, T, V]`, divided by the sampling temperature
    so log-probs match the behaviour policy's.

    Only those T positions go through the LM head (`logits_to_keep`, which Hugging Face causal LMs
    take): the head over the prompt positions would be `[n, P, V]` of work and memory nobody reads
    (SmolLM2's vocabulary is 49,152). A model without `logits_to_keep` computes all and is sliced.
    """
    parts = response_logit_parts(model, inputs, temperature)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def response_logit_parts(model, inputs: dict[str, torch.Tensor], temperature: float) -> list[torch.Tensor]:
    """`response_logits` as the model's passes give them, pieces `[n, t, V]` in order along T:
    what is computed position by position (log-probs, entropies) is computed on each piece and
    its `[n, T]` results joined, instead of copying the `[n, T, V]` logits into one tensor."""
    T = inputs["response_ids"].shape[1]
    P = inputs["input_ids"].shape[1] - T
    parts = _over_shared_prompts(model, inputs, P, T) if shares_prompts(model) else None
    if parts is None:
        predicting = torch.arange(P - 1, P - 1 + T)  # position P-1 predicts response token 0
        kwargs = {"logits_to_keep": predicting} if takes_logits_to_keep(model) else {}
        # without the last response token, which predicts nothing that is read
        ids, mask, positions = (inputs[k][:, :-1] for k in ("input_ids", "attention_mask", "position_ids"))
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs)
        parts = [out.logits if kwargs else out.logits[:, P - 1 : P - 1 + T]]  # [n, T, V]
    parts = [logits.float() for logits in parts]  # a no-op for float32 weights; bf16 logits are upcast once, here
    return parts if temperature == 1.0 else [logits / temperature for logits in parts]


def response_logprobs(model, inputs: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """`[n, T]`: each response token's log-prob under the model's full softmax at `temperature`."""
    return along_response(model, inputs, temperature, lambda logits, ids: (logprobs_from_logits(logits, ids),))[0]


def along_response(model, inputs: dict[str, torch.Tensor], temperature: float, per_part) -> tuple[torch.Tensor, ...]:
    """`per_part(logits [n, t, V], response ids [n, t])`, a tuple of `[n, t]` tensors, run on each
    piece of `response_logit_parts` and joined along T into `[n, T]` tensors."""
    ids, done, results = inputs["response_ids"], 0, []
    for logits in response_logit_parts(model, inputs, temperature):
        results.append(per_part(logits, ids[:, done : done + logits.shape[1]]))
        done += logits.shape[1]
    return tuple(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0] for parts in zip(*results, strict=True))


def _over_shared_prompts(model, inputs: dict[str, torch.Tensor], P: int, T: int) -> list[torch.Tensor] | None:
    """`response_logit_parts` with each distinct prompt run once: a group's samples share their
    prompt, so the prompt pass runs over the distinct prompts (its last position predicts response
    token 0), and its keys and values, copied to every row of the prompt, are the cache the
    responses attend to in a second pass. Gradients reach the prompt pass through the copies,
    summed. The same logits as one pass over prompt + response, up to float rounding
    (tests/test_modeling.py), in two pieces (`[n, 1, V]`, `[n, T - 1, V]`; one when T is 1); None
    when no two rows share a prompt. The response pass leaves out the last response token, which
    predicts nothing that is read. Both passes take `input_ids`, not embeddings computed here: some
    models do more with the ids than embed them (Falcon-H1 scales, Gemma3n derives per-layer inputs)."""
    prompts = torch.cat([inputs["input_ids"][:, :P], inputs["attention_mask"][:, :P]], dim=1)  # [n, 2P]
    distinct, row_prompt = torch.unique(prompts, dim=0, return_inverse=True)
    if len(distinct) == len(prompts):
        return None
    ids, mask = distinct[:, :P], distinct[:, P:]
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    head = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    first = head.logits[row_prompt]  # [n, 1, V]: the last prompt position predicts response token 0
    if T == 1:
        return [first]
    cache = head.past_key_values
    cache.reorder_cache(row_prompt)  # [distinct, ...] -> [n, ...], each row its prompt's
    rest = model(
        input_ids=inputs["input_ids"][:, P : P + T - 1],  # the last response token predicts nothing that is read
        attention_mask=inputs["attention_mask"][:, : P + T - 1],
        position_ids=inputs["position_ids"][:, P : P + T - 1],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=0,  # all: response position t predicts response token t + 1
    )
    return [first, rest.logits]  # [n, 1, V], [n, T - 1, V]


def shares_prompts(model) -> bool:
    """Whether `model` runs each distinct prompt of a batch once (`_over_shared_prompts`): a Hugging
    Face causal LM that takes `logits_to_keep` and a key-value cache, without gradient
    checkpointing (which turns the cache off), and not under ZeRO-3, where every forward pass
    gathers the weights from all ranks: ranks whose rows share prompts differently would make
    different numbers of passes and wait for each other forever."""
    module = getattr(model, "module", model)
    partitioned = getattr(model, "zero_optimization_partition_weights", None)
    return (
        takes_logits_to_keep(model)
        and "past_key_values" in _forward_parameters(type(module))
        and not getattr(module, "is_gradient_checkpointing", False)
        and not (partitioned is not None and partitioned())
    )


def takes_logits_to_keep(model) -> bool:
    """Whether `model` (or the module a DeepSpeed engine wraps) computes logits for chosen positions only."""
    return _forward_takes_logits_to_keep(type(getattr(model, "module", model)))


def _forward_takes_logits_to_keep(cls: type) -> bool:
    return "logits_to_keep" in _forward_parameters(cls)


@functools.cache
def _forward_parameters(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


COMPLETIONS = ("chosen", "rejected")  # the two sides of a preference pair


def completion_view(pairs: Mapping[str, np.ndarray], side: str) -> dict[str, np.ndarray]:
    """One side of a batch of preference pairs (`pipelines.data.preferences.encode_pairs`) as a
    batch of sequences: its prompt and the `side` completion as the response."""
    return {
        "prompt_ids": pairs["prompt_ids"],
        "prompt_mask": pairs["prompt_mask"],
        "response_ids": pairs[f"{side}_ids"],
        "response_mask": pairs[f"{side}_mask"],
    }


def completion_logprobs(model, pairs: Mapping[str, np.ndarray], rows: np.ndarray, side: str) -> torch.Tensor:
    """Summed log-probability `[n]` of the `side` completion of each pair in `rows`, at the
    model's own temperature (1): DPO compares these sequence log-probs."""
    inputs = sequence_tensors(completion_view(pairs, side), rows)
    logp = response_logprobs(model, inputs, 1.0) * inputs["response_mask"]  # [n, T]
    return logp.sum(dim=-1)  # [n, T] -> [n]


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A reward model's score of each sequence `[n, L]` -> `[n]`: its one logit, which a
    sequence-classification model reads at the last token that is not padding."""
    return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].float()


def completion_scores(model, pairs: Mapping[str, np.ndarray], rows: np.ndarray, side: str) -> torch.Tensor:
    """A reward model's score `[n]` of the `side` sequence of each pair in `rows`
    (`pipelines.data.preferences.encode_reward_pairs` arrays)."""
    ids, mask = (torch.from_numpy(pairs[f"{side}_{key}"][rows]) for key in ("input_ids", "attention_mask"))
    return sequence_scores(model, ids, mask)

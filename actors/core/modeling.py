"""What every role that runs the policy model shares: its inputs and its response logits.

The learner, the reference scorer and the critic all feed a rollout batch's prompt + response
through a causal LM the same way; this module is that one way, so none depends on another.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, use_gqa_in_sdpa

from actors.core import lm_head
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
    fused = packed_token_logprobs(model, inputs, temperature)
    if fused is not None:
        return fused[0]
    return along_response(model, inputs, temperature, lambda logits, ids: (logprobs_from_logits(logits, ids),))[0]


def along_response(model, inputs: dict[str, torch.Tensor], temperature: float, per_part) -> tuple[torch.Tensor, ...]:
    """`per_part(logits [n, t, V], response ids [n, t])`, a tuple of `[n, t]` tensors, run on each
    piece of `response_logit_parts` and joined along T into `[n, T]` tensors; or, where the rows'
    prompts can be packed with their responses (`_packed_response_logits`), run on the packed
    sequences' logits `[1, K, V]` (the K positions that predict a response token) and the
    response token each predicts `[1, K]`, and on the logits that predict each row's first
    response token (at its prompt's last position, one for every row of the prompt) `[F, V]` and
    those tokens `[F]`; the results at the response tokens put in place in `[n, T]` tensors (0 at
    padding). The packed logits are not gathered into `[R, V]` first: that copy, and its backward
    (a zero `[1, K, V]` gradient the rows are scattered into, added to the other), took ~5% of a
    SmolLM2 update. `per_part` then also runs at the prompts' last positions, whose results there
    are not read (their gradient is 0): K is R less the rows' first tokens plus the distinct
    prompts that have a row with a response."""
    ids, done, results = inputs["response_ids"], 0, []
    packed = _packed_response_logits(model, inputs, temperature)
    if packed is not None:
        logits, predicted, (pick, where), (first_at, first_rows) = packed
        logits, first_logits = _WithRows.apply(logits, *first_at)
        rest, first = per_part(logits, predicted), per_part(first_logits, ids[first_rows, 0])
        return tuple(
            torch.zeros(ids.shape, dtype=r.dtype, device=r.device)
            .index_put(where, r[pick])
            .index_put_((first_rows, torch.zeros_like(first_rows)), f)
            for r, f in zip(rest, first, strict=True)
        )
    for logits in response_logit_parts(model, inputs, temperature):
        results.append(per_part(logits, ids[:, done : done + logits.shape[1]]))
        done += logits.shape[1]
    return tuple(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0] for parts in zip(*results, strict=True))


# Causal LMs that hand a 4D attention mask and extra keyword arguments to their attention function
# as they are, and look that function up by `config._attn_implementation` at each call
# (transformers 5.19's code for each; sliding windows are checked per config): `_packed_attention`.
PACKABLE_LMS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
# Packed sequences all this short share one padded attention call (`_packed_attention`)
PADDED_ATTENTION_LENGTH = 64
PACKED_MASK_ELEMENTS = 1 << 22  # the most attention-mask entries (the sum of each packed sequence's [l, l]) a packed pass builds


class _WithRows(torch.autograd.Function):
    """`(logits, logits[seqs, cols])`: the logits as they are and a copy of some of their rows. The
    backward adds the rows' gradient to a copy of the logits' gradient, where autograd's indexing
    would scatter it into a zero tensor of the logits' size and add the two. A copy, not in place:
    the gradient autograd hands over may also be another input's (an `alias + b` in `per_part`)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, seqs: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(seqs, cols)
        return logits.detach(), logits[seqs, cols]  # detached: an alias, not a view made inside a Function

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor, grad_rows: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        seqs, cols = ctx.saved_tensors
        return grad.index_put((seqs, cols), grad_rows, accumulate=True), None, None


def _packed_response_logits(
    model, inputs: dict[str, torch.Tensor], temperature: float
) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple, tuple], tuple[tuple, torch.Tensor]] | None:
    """The rows packed (`_packed_sequences`) and run through the model in one forward pass.
    Returns the logits `[1, K, V]` (divided by `temperature`) of the K packed positions that
    predict a response token (the LM head runs there only), in order; the response token each
    of those positions predicts `[1, K]` (0 at the prompts' last positions); for the other
    response tokens, row by row, the `(0, k)` in `[1, K]` of the positions that predict them and
    their `(rows, columns)` in `[n, T]`; and for each row with a response, the `(0, k)` of its
    prompt's last position, which predicts its first token, and the row. None where the rows do
    not pack."""
    packed = _packed_sequences(model, inputs)
    if packed is None:
        return None
    at = packed.at
    keep = torch.unique(at["out_flat"])  # sorted: the positions that predict something, once each
    k = torch.searchsorted(keep, at["out_flat"])  # each response token's predicting position in [K]
    out = packed.forward(model, logits_to_keep=keep)
    logits = out.logits.float()  # [1, K, V]
    later = at["out_t"] > 0  # the tokens after a row's first: each predicted from its own position
    zeros = torch.zeros_like(k)
    pick = (zeros[later], k[later])
    where = (at["out_row"][later], at["out_t"][later])
    predicted = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device).index_put_(
        pick, inputs["response_ids"][where]
    )
    opening = ~later
    first_at = (zeros[opening], k[opening])
    logits = logits if temperature == 1.0 else logits / temperature
    return logits, predicted, (pick, where), (first_at, at["out_row"][opening])


def packed_token_logprobs(
    model, inputs: dict[str, torch.Tensor], temperature: float, with_entropy: bool = False, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`[n, T]` each (0 at padding): each response token's log-prob under the model's full softmax
    at `temperature`, and (`with_entropy`) that softmax's entropy, with a gradient where
    `entropy_grad` (a loss term), else a value. The
    rows packed as `_packed_sequences` says and run through the model in one pass; its
    last hidden state at the positions that predict a response token goes through the LM head
    and the log-probs together, a chunk of the vocabulary at a time (actors/core/lm_head.py), so
    no `[R, V]` logits or gradient are ever whole. The numbers of `along_response` with
    `token_logprobs`, to float rounding (tests/test_modeling.py). None where the rows do not pack
    or the head is not a float32 linear map without bias (`lm_head.fuses`): the caller takes
    `along_response`."""
    module = getattr(model, "module", model)
    head = module.get_output_embeddings()
    packed = _packed_sequences(model, inputs) if lm_head.fuses(head) else None
    if packed is None:
        return None
    # The model as it is called elsewhere (a DeepSpeed engine's forward runs, with its backward
    # hooks), its LM head at no position: the last hidden state (after the final norm) is what
    # Llama, Mistral, Qwen2 and Qwen3 (`PACKABLE_LMS`) hand their head, unscaled.
    nowhere = torch.empty(0, dtype=torch.long, device=packed.ids.device)
    out = packed.forward(model, logits_to_keep=nowhere, output_hidden_states=True)
    at = packed.at
    hidden = out.hidden_states[-1][0, at["out_flat"]]  # [1, N, d] -> [R, d]: the position predicting each token
    hidden = hidden if temperature == 1.0 else hidden / temperature
    where = (at["out_row"], at["out_t"])  # each of those tokens in [n, T]
    logp, entropy = lm_head.token_logprobs(hidden, head, inputs["response_ids"][where], with_entropy, entropy_grad)  # [R] each

    def in_place(values: torch.Tensor) -> torch.Tensor:  # [R] -> [n, T]
        return torch.zeros(inputs["response_ids"].shape, dtype=values.dtype, device=values.device).index_put(where, values)

    return in_place(logp), None if entropy is None else in_place(entropy)


PACKED_ATTENTION = "raypo_packed"  # the name `_packed_attention` is registered under in transformers


@dataclass(frozen=True)
class _Packed:
    """`_packed_sequences`: the packed sequences one after another in one row of N tokens, no padding."""

    ids: torch.Tensor  # [1, N]
    positions: torch.Tensor  # [1, N]
    lengths: list[int]  # each sequence's tokens, in order along N
    masks: list[torch.Tensor]  # each sequence's [1, 1, l, l] attention mask: True where a position may attend
    at: dict[str, torch.Tensor]  # `_packing`'s columns as tensors, and `flat`, `out_flat`: their places along N
    padded: torch.Tensor | None = None  # short sequences: each token's place in [D * L], `masks` one [D, 1, L, L]

    def forward(self, model, **kwargs):
        """`model(..., **kwargs)` over the row, its attention layers calling `_packed_attention` for
        this one pass (the backward calls no attention function, but gradient checkpointing would:
        see `_packed_sequences`). Its inputs: the row, its positions, the sequences' masks
        (`packed_sequences`, which `_packed_attention` reads), and as `attention_mask` an empty 4D
        tensor, which Hugging Face models hand to the attention as it is (no `[N, N]` mask is
        built), and which any other attention would refuse at once rather than ignore. No cache
        (`use_cache=False`): `kwargs` may not set it."""
        config = getattr(model, "module", model).config
        before = config._attn_implementation
        config._attn_implementation_internal = PACKED_ATTENTION
        try:
            return model(
                input_ids=self.ids,
                position_ids=self.positions,
                attention_mask=torch.ones(1, 1, 0, 0, dtype=torch.bool, device=self.ids.device),
                packed_sequences=(self.lengths, self.masks, self.padded),
                use_cache=False,
                **kwargs,
            )
        finally:
            config._attn_implementation_internal = before


def _packed_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs
) -> tuple[torch.Tensor, None]:
    """Attention over the packed sequences of one row (`_Packed.forward`): each sequence's
    queries against its own keys under its own mask, by SDPA, so the linear layers never run over
    padding, and no sequence attends across another's. A call per sequence; where all are short
    (`_Packed.padded`), one call over them copied into `[D, L]`, padded to the longest (16 calls a
    layer, each with its splits and autograd nodes, made the tiny model's update ~6% slower than
    one). `query` `[1, H, N, d]`, `key` and `value` `[1, KV, N, d]` (grouped heads as they come);
    returns `[1, N, H, d]`, as transformers' attention functions do."""
    lengths, masks, padded = kwargs["packed_sequences"]
    gqa = query.shape[1] != key.shape[1]
    if gqa and query.device.type != "cpu" and not use_gqa_in_sdpa(masks[0], key, value):
        # as transformers' SDPA does: CUDA's kernels take grouped heads only without a mask (else the
        # math kernel, keeping [heads, l, l] for the backward); the CPU flash kernel takes both
        groups = query.shape[1] // key.shape[1]
        key, value, gqa = repeat_kv(key, groups), repeat_kv(value, groups), False
    if padded is not None:  # short sequences: one call over them padded to the longest, copied in and out
        D, L = masks[0].shape[0], masks[0].shape[-1]

        def to_padded(t: torch.Tensor) -> torch.Tensor:  # [1, heads, N, d] -> [D, heads, L, d]
            rows = t.transpose(1, 2)[0]  # [N, heads, d]
            out = rows.new_zeros(D * L, *rows.shape[1:]).index_copy(0, padded, rows)
            return out.view(D, L, *rows.shape[1:]).transpose(1, 2)

        q, k, v = (to_padded(t) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=masks[0], dropout_p=dropout, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(D * L, out.shape[1], out.shape[3]).index_select(0, padded)[None], None
    # Split along N in the `[1, N, heads, d]` order the projections made (the gradients then come
    # back joined in that order, which the projections' backward reads without a copy).
    q, k, v = (t.transpose(1, 2).split(lengths, dim=1) for t in (query, key, value))
    out = [
        F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in qkv), attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
        ).transpose(1, 2)
        for *qkv, mask in zip(q, k, v, masks, strict=True)
    ]
    return torch.cat(out, dim=1), None


AttentionInterface.register(PACKED_ATTENTION, _packed_attention)


def _packed_sequences(model, inputs: dict[str, torch.Tensor]) -> _Packed | None:
    """Each distinct prompt once, followed by every response that shares it, as one sequence;
    the sequences one after another in one row, run in one forward pass: a response attends to its
    prompt and to its own earlier tokens only (each sequence's mask, `_packed_attention`), at the
    positions it would have after its prompt alone. No padding: the linear layers run over the
    real tokens only (padding the sequences to the longest cost 5-30% more tokens on
    examples/smollm2's batches). Up to float rounding the logits of one pass over each row's
    prompt + response (tests/test_modeling.py), with one pass instead of two and no key-value
    copies; the rounding depends on which rows are packed together, which in bf16 is ~1e-3.

    None where it does not apply: a model not in `PACKABLE_LMS` (or with attention other than
    SDPA or eager, or a sliding window shorter than a packed sequence, or without
    `logits_to_keep`), ZeRO-3 (ranks would pass different shapes), gradient checkpointing with a
    graph (its backward runs the attention again, outside `_Packed.forward`), rows that share
    no prompt, an empty prompt or no response token at all, or sequences whose masks would have
    more than `PACKED_MASK_ELEMENTS` entries."""
    module = getattr(model, "module", model)
    config = getattr(module, "config", None)
    if (
        type(module).__name__ not in PACKABLE_LMS
        or getattr(config, "_attn_implementation", None) not in ("sdpa", "eager")
        or not takes_logits_to_keep(model)
        or _partitioned(model)
        or (getattr(module, "is_gradient_checkpointing", False) and torch.is_grad_enabled())
    ):
        return None
    T = inputs["response_ids"].shape[1]
    P = inputs["input_ids"].shape[1] - T
    distinct, row_prompt = _distinct_prompts(inputs, P)
    prompt_lengths, response_lengths = distinct[:, P:].sum(dim=1).tolist(), inputs["response_mask"].sum(dim=1).tolist()
    if len(distinct) == len(row_prompt) or min(prompt_lengths) == 0 or sum(response_lengths) == 0:
        return None
    layout = _packing(P, prompt_lengths, row_prompt.tolist(), response_lengths)
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    lengths = layout.pop("lengths")
    if sum(n * n for n in lengths) > PACKED_MASK_ELEMENTS or (window is not None and max(lengths) > window):
        return None
    device = inputs["input_ids"].device
    at = {key: torch.tensor(value, dtype=torch.long, device=device) for key, value in layout.items()}
    starts = torch.tensor([0, *lengths[:-1]], dtype=torch.long, device=device).cumsum(dim=0)
    at["flat"], at["out_flat"] = starts[at["seq"]] + at["col"], starts[at["out_seq"]] + at["out_col"]
    N = sum(lengths)
    ids = torch.zeros(1, N, dtype=torch.long, device=device)
    ids[0, at["flat"]] = inputs["input_ids"][at["source_row"], at["source_col"]]
    positions = torch.zeros(1, N, dtype=torch.long, device=device)
    positions[0, at["flat"]] = at["position"]
    segments = torch.zeros(N, dtype=torch.long, device=device)
    segments[at["flat"]] = at["segment"]  # 0: a prompt, r + 1: row r's response
    D, L = len(lengths), max(lengths)
    if L <= PADDED_ATTENTION_LENGTH and D * L * L <= PACKED_MASK_ELEMENTS:
        # short sequences (the tiny model's): one attention call over them, padded; no real token sees the padding
        padded = torch.empty(N, dtype=torch.long, device=device)
        padded[at["flat"]] = at["seq"] * L + at["col"]
        segment = torch.full((D * L,), -1, dtype=torch.long, device=device).index_put_((padded,), segments).view(D, L)
        return _Packed(ids, positions, lengths, [_allowed(segment)[:, None]], at, padded)
    return _Packed(ids, positions, lengths, [_allowed(segment)[None, None] for segment in segments.split(lengths)], at)


def _allowed(segment: torch.Tensor) -> torch.Tensor:
    """`[..., l]` -> `[..., l, l]`, True where a query may attend to a key: causal, and the key in
    the prompt (segment 0) or in the query's own segment (r + 1: row r's response). Padding (-1)
    attends to the prompt and to earlier padding only (never an empty row: itself at least), and
    no real token attends to it (-1 is no real query's segment)."""
    q, k = segment[..., :, None], segment[..., None, :]
    causal = torch.ones(segment.shape[-1], segment.shape[-1], dtype=torch.bool, device=segment.device).tril()
    return causal & ((k == 0) | (k == q))


def _packing(P: int, prompt_lengths: list[int], row_prompt: list[int], response_lengths: list[int]) -> dict:
    """Where everything goes in the sequences of `_packed_sequences`, one per distinct prompt `d`
    (its `prompt_lengths[d]` real tokens, the last of the rows' left-padded prompts of width P), the rows
    `r` in order (`row_prompt[r]`: its prompt; `response_lengths[r]` real response tokens):

    - `seq`, `col`: a packed token's place; `source_row`, `source_col`: where it comes from in
      the rows' `input_ids` (`[n, P + T]`); `segment`, `position`: 0 for the prompt, r + 1 for row
      r's response, and its position id. A response's last token predicts nothing, so it is left
      out; a response of one token has no segment.
    - `out_seq`, `out_col`: the packed positions whose logits predict the response tokens, row
      by row: the prompt's last position (token 0), then the row's segment; `out_row`, `out_t`:
      the token each predicts in `[n, T]`. `lengths`: each sequence's tokens.

    >>> lay = _packing(3, [2], [0, 0], [2, 1])  # one prompt of 2 tokens (1 pad); responses of 2 and 1 tokens
    >>> lay["seq"], lay["col"], lay["segment"], lay["position"], lay["source_row"], lay["source_col"]
    ([0, 0, 0], [0, 1, 2], [0, 0, 1], [0, 1, 2], [0, 0, 0], [1, 2, 3])
    >>> lay["out_col"], lay["out_row"], lay["out_t"], lay["lengths"]
    ([1, 2, 1], [0, 0, 1], [0, 1, 0], [3])
    """
    keys = ("seq", "col", "segment", "position", "source_row", "source_col", "out_seq", "out_col", "out_row", "out_t")
    out: dict = {key: [] for key in keys}
    first_row = {}
    for r, d in enumerate(row_prompt):
        first_row.setdefault(d, r)
    ends = list(prompt_lengths)  # the next free column of each sequence
    for d, r in sorted(first_row.items()):
        p = prompt_lengths[d]
        _extend(
            out,
            seq=[d] * p,
            col=range(p),
            segment=[0] * p,
            position=range(p),
            source_row=[r] * p,
            source_col=range(P - p, P),
        )
    for r, d in enumerate(row_prompt):
        p, size = prompt_lengths[d], max(response_lengths[r] - 1, 0)
        start = ends[d]
        _extend(out, seq=[d] * size, col=range(start, start + size), segment=[r + 1] * size, position=range(p, p + size),
                source_row=[r] * size, source_col=range(P, P + size))  # fmt: skip
        if response_lengths[r]:
            _extend(out, out_seq=[d] * response_lengths[r], out_col=[p - 1, *range(start, start + size)],
                    out_row=[r] * response_lengths[r], out_t=range(response_lengths[r]))  # fmt: skip
        ends[d] = start + size
    out["lengths"] = ends
    return out


def _extend(out: dict, **columns) -> None:
    for key, values in columns.items():
        out[key].extend(values)


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
    distinct, row_prompt = _distinct_prompts(inputs, P)
    if len(distinct) == len(row_prompt):
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
    return (
        takes_logits_to_keep(model)
        and "past_key_values" in _forward_parameters(type(module))
        and not getattr(module, "is_gradient_checkpointing", False)
        and not _partitioned(model)
    )


def _distinct_prompts(inputs: dict[str, torch.Tensor], P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' distinct left-padded prompts (width P) as `[D, 2P]` (ids, then mask) and each row's
    index into them `[n]`."""
    prompts = torch.cat([inputs["input_ids"][:, :P], inputs["attention_mask"][:, :P]], dim=1)  # [n, 2P]
    return torch.unique(prompts, dim=0, return_inverse=True)


def _partitioned(model) -> bool:
    """Whether `model` is a DeepSpeed engine under ZeRO-3 (each rank holds a part of each weight)."""
    partitioned = getattr(model, "zero_optimization_partition_weights", None)
    return partitioned is not None and partitioned()


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

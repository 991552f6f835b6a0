"""Critic: the Ray-free core of the value actor (PPO).

The policy architecture (the causal LM's backbone) with a scalar head, trained with the
clipped value loss on GAE returns. A plain torch optimizer: the critic is one process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel

from actors.core.clipping import clip_in_step
from actors.core.modeling import loss_mask, sequence_tensors
from actors.core.onednn import use_onednn
from pipelines.algos.losses import value_loss


class ValueModel(nn.Module):
    def __init__(self, model_dir: str):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
        self.head = nn.Linear(self.backbone.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # start at V = 0: no made-up baseline before training
        nn.init.zeros_(self.head.bias)

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Value of the state before each response token: `[n, P + T]` -> `[n, T]`."""
        hidden = self.backbone(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], position_ids=inputs["position_ids"]
        ).last_hidden_state  # [n, P + T, H]
        T = inputs["response_ids"].shape[1]
        P = inputs["input_ids"].shape[1] - T
        return self.head(hidden[:, P - 1 : P - 1 + T]).squeeze(-1)  # [n, T, 1] -> [n, T]


class Critic:
    def __init__(self, model_dir: str, lr: float = 3e-5, grad_clip: float = 1.0, clip: float = 0.5, seed: int = 0):
        torch.manual_seed(seed)
        self.model = ValueModel(model_dir)
        use_onednn(self.model)  # float32 matmuls at this CPU's speed (actors/core/onednn.py)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0, fused=True)
        self.grad_clip, self.clip = grad_clip, clip
        self.steps_done = 0

    @torch.no_grad()
    def values(self, batch: Mapping[str, np.ndarray]) -> np.ndarray:
        """`[N, T]` values of the response positions, 0 on padding."""
        self.model.eval()
        inputs = sequence_tensors(batch, np.arange(len(batch["response_ids"])))
        return (self.model(inputs) * inputs["response_mask"]).numpy().astype(np.float32)

    def train_step(self, minibatches: Iterable[Mapping[str, np.ndarray]]) -> dict[str, float]:
        """Fit the values to `returns` (clipped around `old_values`), one optimizer step per
        minibatch; metrics averaged over the minibatches."""
        self.model.train()
        totals = {"value_loss": 0.0, "value_mse": 0.0, "value_clip_fraction": 0.0}
        count = 0
        for batch in minibatches:
            mask = loss_mask(batch)  # samples no reward scored have no return to fit
            if not mask.any():
                continue
            inputs = sequence_tensors(batch, np.arange(len(batch["response_ids"])))
            values = self.model(inputs)
            old = torch.from_numpy(batch["old_values"])
            returns = torch.from_numpy(batch["returns"])
            loss, metrics = value_loss(values, old, returns, mask, clip=self.clip)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            with clip_in_step(self.optimizer, self.model.parameters(), self.grad_clip):
                self.optimizer.step()
            totals["value_loss"] += loss.item()
            totals["value_mse"] += metrics["value_mse"]
            totals["value_clip_fraction"] += metrics["value_clip_fraction"]
            count += 1
        self.steps_done += 1
        return {k: v / max(count, 1) for k, v in totals.items()}

    def save(self, out_dir: str | Path) -> None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.model.state_dict().items()}, str(out_dir / "critic.safetensors"))
        torch.save({"optimizer": self.optimizer.state_dict(), "steps_done": self.steps_done}, out_dir / "critic_optim.pt")

    def load(self, out_dir: str | Path) -> None:
        out_dir = Path(out_dir)
        self.model.load_state_dict(load_file(str(out_dir / "critic.safetensors")))
        state = torch.load(out_dir / "critic_optim.pt", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_done = state["steps_done"]

"""The embedded default model: a tiny Llama with a character-level tokenizer.

`make_tiny(cfg)` builds it deterministically from a seed, warm-starts it with a short SFT on
the built-in tasks so that RL has signal, and saves it in Hugging Face format
(config.json, model.safetensors, tokenizer.json, chat template) under a cache directory
keyed by the config, so a second call returns at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pipelines.config import TinyModelConfig, WarmStartBand
from pipelines.data.evaluate import greedy_accuracy, sampled_accuracy
from pipelines.models.sft import sft_problems, sft_train

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = [chr(i) for i in range(32, 127)] + ["\n"]
# The chat template joins the messages' text after <bos>: the tiny model knows no roles,
# and a user message "12+7=" becomes exactly the prompt it was trained on.
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
MANIFEST = "raypo_tiny.json"
TINY_FORMAT_VERSION = 2  # bump when the build changes, so old caches are not reused


def cache_root() -> Path:
    return Path(os.environ.get("RAYPO_CACHE", Path.home() / ".cache" / "raypo"))


def tiny_dir(cfg: TinyModelConfig) -> Path:
    """Where the tiny model built from `cfg` lives: one directory per config."""
    payload = json.dumps({"v": TINY_FORMAT_VERSION, **cfg.model_dump()}, sort_keys=True)
    digest = hashlib.sha256(payload.encode()).hexdigest()[:12]
    return cache_root() / f"tiny-{digest}"


def build_tokenizer():
    """A character-level tokenizer in Hugging Face format: printable ASCII plus newline,
    one token per character, <bos> prepended on encode."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1 << 30
    return fast


def build_model(cfg: TinyModelConfig, tokenizer):
    """A randomly initialised Llama causal LM of `cfg`'s shape, seeded."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config)


class WarmStartError(RuntimeError):
    """The warm start did not land in its band after every round and attempt; nothing was cached."""


@dataclass(frozen=True)
class BandCheck:
    greedy: float
    sampled: float
    ok: bool

    def describe(self) -> str:
        return f"greedy {self.greedy:.1%}, sampled {self.sampled:.1%}"


def check_band(model, tokenizer, problems: list, band: WarmStartBand, seed: int) -> BandCheck:
    """Greedy and sampling accuracy on the check problems, and whether both lie in `band`."""
    greedy = greedy_accuracy(model, tokenizer, problems)
    sampled = sampled_accuracy(model, tokenizer, problems, band.samples, band.temperature, seed)
    ok = band.min_greedy <= greedy <= band.max_greedy and sampled >= band.min_sampled
    return BandCheck(greedy, sampled, ok)


def band_text(band: WarmStartBand) -> str:
    return f"greedy {band.min_greedy:.0%}-{band.max_greedy:.0%}, sampled >= {band.min_sampled:.0%}"


def warm_start(cfg: TinyModelConfig, tokenizer, train: list, check_problems: list, log: Callable[[str], None] = print):
    """A model of `cfg` warm-started on `train` until it lands in `cfg.band` on `check_problems`:
    the first SFT round, up to `band.extra_rounds` more, and up to `band.attempts` fresh
    initialisations. Returns the model, the check that passed, and the history of checks;
    raises WarmStartError when none passed."""
    band = cfg.band
    history: list[dict] = []
    for attempt in range(band.attempts):
        init_seed = cfg.seed + 1000 * attempt  # attempt 0 is the configured seed itself
        model = build_model(cfg.model_copy(update={"seed": init_seed}), tokenizer)
        for round_ in range(1 + band.extra_rounds):
            first = round_ == 0
            steps = cfg.sft_steps if first else band.extra_round_steps
            log(f"warm-start SFT (attempt {attempt + 1}, round {round_ + 1}): {steps} steps on {len(train)} train problems")
            losses = sft_train(
                model,
                tokenizer,
                train,
                cfg,
                steps=steps,
                lr=cfg.sft_lr if first else cfg.sft_lr / 2,
                seed=init_seed + round_,
                log=log,
            )
            check = check_band(model, tokenizer, check_problems, band, seed=init_seed + round_)
            tail = losses[-100:]
            history.append(
                {
                    "attempt": attempt + 1,
                    "round": round_ + 1,
                    "steps": steps,
                    "loss": sum(tail) / max(1, len(tail)),
                    "greedy": check.greedy,
                    "sampled": check.sampled,
                    "in_band": check.ok,
                }
            )
            verdict = "in band" if check.ok else f"outside the band ({band_text(band)})"
            log(f"  check on {len(check_problems)} held-out problems: {check.describe()}: {verdict}")
            if check.ok:
                return model, check, history
    raise WarmStartError(
        f"the tiny model's warm start did not land in its band ({band_text(band)}) after {band.attempts} "
        f"initialisation(s) x {1 + band.extra_rounds} SFT round(s); last check: {check.describe()}, SFT loss "
        f"{history[-1]['loss']:.3f}. A model outside the band cannot show RL's learning, so nothing was cached. "
        "Try another model.tiny.seed, more model.tiny.sft_steps or a lower model.tiny.sft_lr."
    )


def make_tiny(cfg: TinyModelConfig, force: bool = False, log: Callable[[str], None] = print) -> tuple[Path, dict]:
    """Build, warm-start (until it lands in its band) and save the tiny model, or reuse the
    cached one. Returns its directory and its manifest (the measured accuracies and checks).

    Safe to call from several processes at once (Tune trials, tests): one builds under a file
    lock, the others wait for it and reuse its model; a model is renamed in whole, never seen
    half-written."""
    out = tiny_dir(cfg)
    if not force and (cached := _cached(out, log)):
        return out, cached
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not force and (cached := _cached(out, log)):  # another process built it while this one waited
            return out, cached
        return out, _build(cfg, out, log)


def _cached(out: Path, log: Callable[[str], None]) -> dict | None:
    manifest_path = out / MANIFEST
    if not manifest_path.exists():
        return None
    manifest = json.loads(manifest_path.read_text())
    log(f"tiny model cached at {out} (held-out greedy accuracy {manifest['heldout_accuracy']:.1%})")
    return manifest


def _build(cfg: TinyModelConfig, out: Path, log: Callable[[str], None]) -> dict:
    started = time.monotonic()
    torch.manual_seed(cfg.seed)
    tokenizer = build_tokenizer()
    train, heldout, check_problems = sft_problems(cfg)
    before = greedy_accuracy(build_model(cfg, tokenizer), tokenizer, heldout)
    model, check, history = warm_start(cfg, tokenizer, train, check_problems, log)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"built tiny Llama: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}")
    after = greedy_accuracy(model, tokenizer, heldout)

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    manifest = {
        "format_version": TINY_FORMAT_VERSION,
        "config": cfg.model_dump(),
        "parameters": n_params,
        "heldout_problems": len(heldout),
        "heldout_accuracy_before_sft": before,
        "heldout_accuracy": after,
        "check_greedy_accuracy": check.greedy,
        "check_sampled_accuracy": check.sampled,
        "warm_start_history": history,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "build_seconds": round(time.monotonic() - started, 1),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    old = out.with_name(out.name + f".old{os.getpid()}")
    if out.exists():  # --force over an old build: move it aside first, delete it once the new one is in
        out.rename(old)
    tmp.rename(out)  # atomic: a half-written model is never taken for a cached one
    shutil.rmtree(old, ignore_errors=True)
    log(
        f"tiny model saved to {out}: held-out greedy accuracy {before:.1%} -> {after:.1%} on {len(heldout)} problems "
        f"(sampled {check.sampled:.1%} on the check problems) in {manifest['build_seconds']:.0f}s"
    )
    return manifest

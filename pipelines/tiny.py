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
import time
from collections.abc import Callable
from pathlib import Path

from pipelines.config import TinyModelConfig

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = [chr(i) for i in range(32, 127)] + ["\n"]
# The chat template joins the messages' text after <bos>: the tiny model knows no roles,
# and a user message "12+7=" becomes exactly the prompt it was trained on.
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
MANIFEST = "raypo_tiny.json"
TINY_FORMAT_VERSION = 1  # bump when the build changes, so old caches are not reused


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
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

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
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

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


def make_tiny(cfg: TinyModelConfig, force: bool = False, log: Callable[[str], None] = print) -> tuple[Path, dict]:
    """Build, warm-start and save the tiny model (or reuse the cached one).

    Returns its directory and its manifest (held-out accuracy before and after the SFT).
    """
    out = tiny_dir(cfg)
    manifest_path = out / MANIFEST
    if manifest_path.exists() and not force:
        manifest = json.loads(manifest_path.read_text())
        log(f"tiny model cached at {out} (held-out accuracy {manifest['heldout_accuracy']:.1%})")
        return out, manifest

    import torch

    from pipelines.evaluate import greedy_accuracy
    from pipelines.sft import sft_problems, sft_train

    started = time.monotonic()
    torch.manual_seed(cfg.seed)
    tokenizer = build_tokenizer()
    model = build_model(cfg, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"built tiny Llama: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}")

    train, heldout = sft_problems(cfg)
    before = greedy_accuracy(model, tokenizer, heldout)
    log(f"warm-start SFT: {cfg.sft_steps} steps on {len(train)} train problems")
    sft_train(model, tokenizer, train, cfg, log=log)
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
        "build_seconds": round(time.monotonic() - started, 1),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():  # --force over an old build: swap it out whole
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)  # atomic: a half-written model is never taken for a cached one
    log(
        f"tiny model saved to {out}: held-out greedy accuracy {before:.1%} -> {after:.1%} "
        f"on {len(heldout)} problems in {manifest['build_seconds']:.0f}s"
    )
    return out, manifest

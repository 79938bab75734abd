"""Tiny random causal LMs with a real byte-level tokenizer, saved like any model directory.

No downloads: a Qwen2 config with a few layers, random weights from a seed, and a byte-level
BPE tokenizer without merges (one token per byte) plus chat special tokens and a chat template.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(extra_tokens: int = 0) -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for i in range(extra_tokens):  # a different vocabulary, for the mismatch test
        vocab[f"<extra_{i}>"] = len(vocab)
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=SPECIALS[1:2]
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model_dir(
    path: Path,
    *,
    seed: int,
    layers: int = 2,
    hidden: int = 64,
    extra_tokens: int = 0,
    max_positions: int = 512,
    init_range: float = 0.2,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Writes a model directory loadable by from_pretrained; returns it."""
    tokenizer = build_tokenizer(extra_tokens)
    vocab = len(tokenizer)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        initializer_range=init_range,  # larger than usual, so distributions are far from uniform
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def build_perturbed_copy(source: Path, path: Path, *, seed: int, noise: float) -> Path:
    """A draft that resembles the target: its weights plus Gaussian noise (noise x each tensor's
    std), so acceptance lands between 0 and 1 as with a real model pair."""
    model = Qwen2ForCausalLM.from_pretrained(source)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * noise)
    model.save_pretrained(path)
    PreTrainedTokenizerFast.from_pretrained(source).save_pretrained(path)
    return Path(path)

"""Tiny random causal LMs with a real byte-level tokenizer, saved like any model directory.

No downloads: a Qwen2 config with a few layers, random weights from a seed, and a byte-level
BPE tokenizer without merges (one token per byte) plus chat special tokens and a chat template.
"""

from __future__ import annotations

import json
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
    return _save_random(path, config, tokenizer, seed=seed, dtype=dtype)


def _save_random(path: Path, config: Qwen2Config, tokenizer, *, seed: int, dtype: torch.dtype,
                 device: str = "cpu") -> Path:
    """A Qwen2 model of `config` with random weights (drawn on `device`) and `tokenizer`, saved to path."""
    torch.manual_seed(seed)
    with torch.device(device):
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


def build_tiny_pair(folder: Path) -> tuple[str, str]:
    """The benchmarks' tiny pair (`specdec bench serve --tiny`, tracing --tiny, load): (target, draft) dirs."""
    target = build_model_dir(Path(folder) / "tiny-target", seed=1, layers=2)
    return str(target), str(build_perturbed_copy(target, Path(folder) / "tiny-draft", seed=2, noise=0.05))


def random_q4k_blocks(n: int, k: int, generator: torch.Generator, scale: float = 2e-4) -> torch.Tensor:
    """Random ggml Q4_K blocks for an [n, k] weight (k a multiple of 256): uint8 [n, k / 256 * 144],
    random 6-bit scales and mins and nibbles, float16 d ~ scale and dmin ~ 7 scale (weights about
    +-0.1 around zero), as a GGUF's Q4_K tensor holds them."""
    nb = k // 256
    blocks = torch.randint(0, 256, (n, nb, 144), dtype=torch.uint8, generator=generator)
    d = (torch.rand(n, nb, generator=generator) + 0.5) * scale
    halves = torch.stack([d, d * 7], dim=-1).half().view(torch.uint8).reshape(n, nb, 4)
    blocks[..., :4] = halves
    return blocks.reshape(n, nb * 144)


def random_q6k_blocks(n: int, k: int, generator: torch.Generator, scale: float = 5e-5) -> torch.Tensor:
    """Random ggml Q6_K blocks for an [n, k] weight (k a multiple of 256): uint8 [n, k / 256 * 210],
    random 6-bit values, signed 8-bit sub-block scales in [-64, 63] and float16 d ~ scale (weights
    about +-0.1), as a GGUF's Q6_K tensor holds them."""
    nb = k // 256
    blocks = torch.randint(0, 256, (n, nb, 210), dtype=torch.uint8, generator=generator)
    blocks[..., 192:208] = torch.randint(-64, 64, (n, nb, 16), dtype=torch.int8, generator=generator).view(torch.uint8)
    d = (torch.rand(n, nb, generator=generator) + 0.5) * scale
    blocks[..., 208:210] = d.half()[..., None].view(torch.uint8)
    return blocks.reshape(n, nb * 210)


# the Linears build_gguf_model_dir gives Q6_K blocks (as a Q4_K_M GGUF holds some MLP outputs and values)
GGUF_Q6K = ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.v_proj")


def build_gguf_model_dir(path: Path, *, seed: int, layers: int = 2, mismatch: tuple[str, ...] = (),
                         q6k: tuple[str, ...] = GGUF_Q6K) -> Path:
    """A tiny Qwen2 (hidden 256, so every Linear's input is a multiple of 256 columns) converted as
    model_store converts a GGUF: each Linear but the head holds the float16 rounding of random
    Q4_K blocks' values (Q6_K for those named in `q6k`), and `model.gguf` beside it holds those
    blocks under their GGUF names, named by source.json. The Linears named in `mismatch` get other
    blocks in the GGUF than the store holds (as a tensor the conversion permuted would)."""
    import json

    import gguf

    from specdec.kernels import q4k_dequantize, q6k_dequantize

    path = Path(path)
    build_model_dir(path, seed=seed, layers=layers, hidden=256, dtype=torch.float16)
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float16)
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == "qwen2")
    names = gguf.get_tensor_name_map(arch, layers)
    writer = gguf.GGUFWriter(str(path / "model.gguf"), "qwen2")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear) or module is model.lm_head:
                continue
            n, k = module.weight.shape
            random_blocks, dequantize, kind = ((random_q6k_blocks, q6k_dequantize, gguf.GGMLQuantizationType.Q6_K)
                                               if name in q6k else
                                               (random_q4k_blocks, q4k_dequantize, gguf.GGMLQuantizationType.Q4_K))
            blocks = random_blocks(n, k, gen)
            module.weight.copy_(dequantize(blocks).half())
            stored = random_blocks(n, k, gen) if name in mismatch else blocks
            writer.add_tensor(names.get_name(f"{name}.weight", try_suffixes=(".weight",)), stored.numpy(),
                              raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.save_pretrained(path)
    (path / "source.json").write_text(json.dumps({"source_gguf": str((path / "model.gguf").resolve())}))
    return path


# The shapes of real models (their config.json on the hub), for benchmarks on machines that have
# no weights (a GPU machine here has no network): pass costs, batching and round trips are real,
# acceptance is not (specdec bench serve --synthetic-acceptance).
REAL_SHAPES = {
    "qwen2.5-coder-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-coder-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-coder-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                             num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}


def build_real_shape_dir(path: Path, name: str, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                         device: str = "cpu") -> Path:
    """A model directory with the shapes of REAL_SHAPES[name], random weights (std 0.02) and the
    byte-level tokenizer padded with placeholder tokens to the real vocabulary size (so every id
    the head can produce decodes). Models of one vocabulary size share one tokenizer."""
    shape = REAL_SHAPES[name]
    tokenizer = build_tokenizer(extra_tokens=shape["vocab_size"] - len(build_tokenizer()))
    assert len(tokenizer) == shape["vocab_size"], (len(tokenizer), shape)
    config = Qwen2Config(**shape, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    return _save_random(path, config, tokenizer, seed=seed, dtype=dtype, device=device)


def build_head_dir(path: Path, *, target_hidden: int, target_vocab: int, seed: int, layout: str = "vllm",
                   hidden: int | None = None, heads: int = 4, kv_heads: int = 2, intermediate: int | None = None,
                   draft_vocab: int | None = None, feature_layers: tuple[int, ...] | None = None,
                   with_embedding: bool = False, std: float = 0.2, rope_theta: float = 10000.0,
                   draft_ids: list[int] | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """An EAGLE-3 head directory with random weights (std `std`) for a target of width target_hidden
    and vocabulary target_vocab, in vLLM's layout ("vllm": LlamaForCausalLMEagle3, midlayer.*) or
    the speculators one ("speculators": transformer_layer_config, layers.0.*). draft_vocab: the
    head scores that many ids, spread over the vocabulary by a random d2t (None: all of them);
    draft_ids: exactly these ids instead (one id: a head that always proposes it)."""
    from safetensors.torch import save_file

    d = hidden or target_hidden
    inter = intermediate or 2 * d
    dv = len(draft_ids) if draft_ids else draft_vocab or target_vocab
    head_dim = d // heads
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    layer = "midlayer." if layout == "vllm" else "layers.0."
    state = {"fc.weight": w(d, 3 * target_hidden), "norm.weight": 1 + w(d) / 4, "lm_head.weight": w(dv, d)}
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        state[f"{layer}{name}.weight"] = 1 + w(d) / 4
    for name, shape in (("q_proj", (heads * head_dim, 2 * d)), ("k_proj", (kv_heads * head_dim, 2 * d)),
                        ("v_proj", (kv_heads * head_dim, 2 * d)), ("o_proj", (d, heads * head_dim))):
        state[f"{layer}self_attn.{name}.weight"] = w(*shape)
    for name, shape in (("gate_proj", (inter, d)), ("up_proj", (inter, d)), ("down_proj", (d, inter))):
        state[f"{layer}mlp.{name}.weight"] = w(*shape)
    ids = torch.sort(torch.tensor(draft_ids) if draft_ids else torch.randperm(target_vocab, generator=g)[:dv]).values
    state["d2t"] = ids - torch.arange(dv)
    state["t2d"] = torch.zeros(target_vocab, dtype=torch.bool).index_fill_(0, ids, True)
    if with_embedding:
        state["embed_tokens.weight"] = w(target_vocab, d)
    layer_config = {"hidden_size": d, "intermediate_size": inter, "num_attention_heads": heads,
                    "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-6, "rope_theta": rope_theta,
                    "max_position_embeddings": 4096, "vocab_size": target_vocab, "hidden_act": "silu"}
    extra = {"target_hidden_size": target_hidden} if d != target_hidden else {}
    if layout == "vllm":
        config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **layer_config,
                  "num_hidden_layers": 1, "draft_vocab_size": dv, **extra,
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(feature_layers)} if feature_layers else {}}
    else:
        config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                  "transformer_layer_config": {**layer_config, "num_hidden_layers": 1, "model_type": "llama"},
                  "draft_vocab_size": dv, "norm_before_residual": True, **extra,
                  **({"eagle_aux_hidden_state_layer_ids": list(feature_layers)} if feature_layers else {})}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


def main(argv: list[str] | None = None) -> int:
    """python -m specdec_tools.testing.tiny_models OUT NAME [--device cuda]: a REAL_SHAPES model directory."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("out")
    p.add_argument("name", choices=sorted(REAL_SHAPES))
    p.add_argument("--device", default="cpu", help="where the random weights are drawn (cuda: faster)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(build_real_shape_dir(Path(a.out), a.name, seed=a.seed, device=a.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

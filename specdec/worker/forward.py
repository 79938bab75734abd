"""One forward pass of a worker's model over a ragged batch (specdec/worker/batching.py).

`model_forward(model)` gives the function the engine's passes call: for the Llama/Qwen2 family
(decoder layers of norm, attention with rotary positions, norm, gated MLP) `lean_forward`, the
very ops of transformers' forward in the same order, so the same bits (tested against it), but
without its per-layer plumbing: the output-capturing and config-merging decorators, the keyword
arguments every module passes on, the mask functions, the attention-interface lookup, the module
calls around each norm, attention block and MLP, and the dtype casts that do nothing in float32.
A decoding step runs 28 such layers in the default target and 24 in its draft; on this 2-core VM
that plumbing was 1.5 ms of a 47 ms target pass and 1.8 ms of a 22 ms draft step. Any other model,
a model whose layers look otherwise, and one that accelerate spread over devices (`--device-map`:
its hooks on each layer move the tensors) runs transformers' own forward.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from specdec.worker.batching import NO_MASK, RaggedCache, ragged_attention

# (model class, decoder layer class) pairs whose forward lean_forward repeats op for op
_FAMILY = {"Qwen2ForCausalLM": "Qwen2DecoderLayer", "LlamaForCausalLM": "LlamaDecoderLayer"}

Forward = Callable[[torch.Tensor, torch.Tensor, RaggedCache, torch.Tensor], torch.Tensor]


def model_forward(model) -> Forward:
    """forward(ids [1, n], positions [1, n], cache, keep_rows) -> logits [1, len(keep_rows), vocab].
    SPECDEC_LEAN_FORWARD=0 keeps transformers' forward for every model (the ablation)."""
    if os.environ.get("SPECDEC_LEAN_FORWARD", "1") != "0" and lean_forward_fits(model):
        return lambda ids, positions, cache, keep: lean_forward(model, ids, positions, cache, keep)

    def plain(ids, positions, cache, keep):
        return model(input_ids=ids, position_ids=positions, attention_mask=NO_MASK, past_key_values=cache,
                     use_cache=True, logits_to_keep=keep).logits
    return plain


def lean_forward_fits(model) -> bool:
    """Whether lean_forward computes exactly what this model's own forward does."""
    layer_class = _FAMILY.get(type(model).__name__)
    inner = getattr(model, "model", None)
    if layer_class is None or inner is None or getattr(model, "hf_device_map", None):
        return False
    config = inner.config
    return (all(type(layer).__name__ == layer_class for layer in inner.layers)
            and len(inner.layers) == config.num_hidden_layers
            and all(t == "full_attention" for t in getattr(config, "layer_types", None) or ["full_attention"])
            and not getattr(config, "pretraining_tp", 1) > 1)


def _rms_norm(norm, h: torch.Tensor) -> torch.Tensor:
    """Qwen2RMSNorm / LlamaRMSNorm.forward, its casts only where they change something."""
    dtype = h.dtype
    x = h if dtype == torch.float32 else h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * (x if dtype == torch.float32 else x.to(dtype))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def lean_forward(model, ids: torch.Tensor, positions: torch.Tensor, cache: RaggedCache,
                 keep: torch.Tensor) -> torch.Tensor:
    """The ragged pass through a Llama/Qwen2-family model, op for op its forward (see the module
    docstring) -> logits [1, len(keep), vocab]."""
    inner = model.model
    h = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(h, positions)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # once, where apply_rotary_pos_emb does it per layer
    n = ids.shape[1]
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        x = _rms_norm(layer.input_layernorm, h)
        shape = (1, n, -1, attn.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)
        k = attn.k_proj(x).view(shape).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        keys, values = cache.update(k, v, i)
        o, _ = ragged_attention(attn, q, keys, values, None, scaling=attn.scaling)
        h = h + attn.o_proj(o.reshape(1, n, -1).contiguous())
        x = _rms_norm(layer.post_attention_layernorm, h)
        h = h + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
    h = _rms_norm(inner.norm, h)
    return model.lm_head(h[:, keep, :])

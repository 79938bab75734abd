"""One forward pass of a worker's model over a ragged batch (specdec/worker/batching.py).

`model_forward(model)` gives the function the engine's passes call: where every projection of a
Llama/Qwen2-family model runs on the native row kernels (the CPU defaults, int4-rows and int8-rows),
`NativeForward`: the decoder layers in C (specdec/csrc/decoder.c), one call a pass, where torch's
ops cost ~35 dispatches a layer, a sizeable part of a 1-row pass on CPU
(docs/benchmarks/native-decoder/). Otherwise, for the Llama/Qwen2 family
(decoder layers of norm, attention with rotary positions, norm, gated MLP) `lean_forward`, the
very ops of transformers' forward in the same order, so the same bits (tested against it), but
without its per-layer plumbing: the output-capturing and config-merging decorators, the keyword
arguments every module passes on, the mask functions, the attention-interface lookup, the module
calls around each norm, attention block and MLP, and the dtype casts that do nothing in float32.
A decoding step runs 28 such layers in the default target and 24 in its draft, so that plumbing
costs a few percent of a CPU pass (docs/benchmarks/huge-pages-lean-forward/). Any other model,
a model whose layers look otherwise, and one that accelerate spread over devices (`--device-map`:
its hooks on each layer move the tensors) runs transformers' own forward.
"""

from __future__ import annotations

from typing import Callable

import torch

from specdec import envs, kernels
from specdec.worker.batching import NO_MASK, RaggedCache, cache_room, ragged_attention

# (model class, decoder layer class) pairs whose forward lean_forward repeats op for op
_FAMILY = {"Qwen2ForCausalLM": "Qwen2DecoderLayer", "LlamaForCausalLM": "LlamaDecoderLayer"}

Forward = Callable[[torch.Tensor, torch.Tensor, RaggedCache, torch.Tensor], torch.Tensor]


def model_forward(model) -> Forward:
    """forward(ids [1, n], positions [1, n], cache, keep_rows, aux=()) -> logits [1, len(keep_rows), vocab];
    with aux (layer indices), (logits, features [n, len(aux) * hidden]): each row's residual stream
    entering those layers, side by side (what an EAGLE-3 head reads: specdec/eagle3.py).
    SPECDEC_NATIVE_FORWARD=0 keeps lean_forward where native_forward would run, SPECDEC_LEAN_FORWARD=0
    transformers' forward for every model (the ablations)."""
    lean = envs.on("SPECDEC_LEAN_FORWARD") and lean_forward_fits(model)
    if lean and envs.on("SPECDEC_NATIVE_FORWARD") and native_forward_fits(model):
        return NativeForward(model)
    if lean:
        return lambda ids, positions, cache, keep, aux=(): lean_forward(model, ids, positions, cache, keep, aux)

    def plain(ids, positions, cache, keep, aux=()):
        out = model(input_ids=ids, position_ids=positions, attention_mask=NO_MASK, past_key_values=cache,
                    use_cache=True, logits_to_keep=keep, output_hidden_states=bool(aux))
        if not aux:
            return out.logits
        # hidden_states[i]: the stream entering layer i (hidden_states[0] the embeddings)
        return out.logits, torch.cat([out.hidden_states[i][0] for i in aux], dim=-1)
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
                 keep: torch.Tensor, aux: tuple[int, ...] = ()):
    """The ragged pass through a Llama/Qwen2-family model, op for op its forward (see the module
    docstring) -> logits [1, len(keep), vocab]; with aux, (logits, features [n, len(aux) * hidden]:
    each row's residual stream entering the layers of aux, side by side)."""
    inner = model.model
    h = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(h, positions)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # once, where apply_rotary_pos_emb does it per layer
    n = ids.shape[1]
    captured = {}
    for i, layer in enumerate(inner.layers):
        if i in aux:
            captured[i] = h[0]
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
    logits = model.lm_head(h[:, keep, :])
    return (logits, torch.cat([captured[i] for i in aux], dim=-1)) if aux else logits


# ---- the native forward: the decoder layers in C (specdec/csrc/decoder.c) ----------------------

_PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
                ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))  # decoder.c's sd_layer order


def native_forward_fits(model) -> bool:
    """Whether NativeForward runs this model: lean_forward's family (checked by the caller), float32 on
    CPU, SiLU MLPs, one norm epsilon, and every projection on the native row kernels (int8-rows, or
    the GGUF's Q4_K or Q6_K blocks: quantize int8-rows or int4-rows where the kernel builds)."""
    inner, config = model.model, model.config
    if kernels.native_library() is None or getattr(config, "hidden_act", None) != "silu":
        return False
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = inner.layers[0].self_attn.head_dim
    if heads % kv_heads or head_dim % 2 or head_dim > 512:
        return False
    norms = [inner.norm] + [n for layer in inner.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    tensors = [inner.embed_tokens.weight] + [n.weight for n in norms]
    return (all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)
            and len({n.variance_epsilon for n in norms}) == 1
            and len({layer.self_attn.scaling for layer in inner.layers}) == 1
            and all(_native_kind(getattr(getattr(layer, block), name)) for layer in inner.layers
                    for block, name in _PROJECTIONS))


def _native_kind(module) -> int:
    """decoder.c's sd_linear kind of a projection: 1 int8-rows on the native kernel, 2 Q4_K blocks,
    3 Q6_K blocks, 0 none of them."""
    if isinstance(module, (kernels.Q4KRowLinear, kernels.Q6KRowLinear)):
        return 2 if isinstance(module, kernels.Q4KRowLinear) else 3
    return 1 if isinstance(module, kernels.Int8RowLinear) and module.backend == "native" else 0


def _linear_fields(module) -> list[int]:
    """decoder.c's sd_linear: kind, K, N, Kp, weights, their second tensor, scales, bias (0: none)."""
    if _native_kind(module) in (2, 3):
        qs, meta, bias = module._ptrs
        return [_native_kind(module), module.in_features, module.out_features, module.padded_features, qs, meta, 0,
                bias or 0]
    weight, wsum, scale, bias = module._ptrs
    return [1, module.in_features, module.out_features, module._columns, weight, wsum, scale, bias or 0]


class NativeForward:
    """The pass of a model native_forward_fits: embeddings and rotary angles in torch, every decoder
    layer and the final norm in one call to specdec_decoder_pass (specdec/csrc/decoder.c), the head
    in torch. Each session's keys and values go straight into its grow_append buffers
    (batching.cache_room makes room first; the layers' tensors become views of the rows written
    after the call, so a failed call leaves the caches as they were), whatever `append` the
    RaggedCache names. Rows are computed one by one in a fixed order (decoder.c): a k-row verify is
    bitwise k single steps, as with lean_forward; against lean_forward's float32 ops the results
    differ by rounding (other summation orders and exp)."""

    def __init__(self, model):
        self.model, self.inner = model, model.model
        config, attn = model.config, self.inner.layers[0].self_attn
        self.layers = len(self.inner.layers)
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
        self.eps, self.scaling = self.inner.norm.variance_epsilon, attn.scaling
        self._like = torch.empty(1, self.kv_heads, 0, self.head_dim)  # the caches' dtype, device and shape
        self._decoder = kernels.native_library().decoder
        self._generation = -1
        self._tables: tuple = ()

    def _model_table(self) -> int:
        """decoder.c's sd_model (and its sd_layer array), remade whenever torch moved the kernels' tensors."""
        if self._generation != kernels.bind_generation():
            inner = self.inner
            layers = torch.tensor([[layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr()]
                                   + [f for block, name in _PROJECTIONS for f in _linear_fields(getattr(getattr(layer, block), name))]
                                   for layer in inner.layers], dtype=torch.int64)
            model = torch.tensor([self.layers, self.model.config.hidden_size, self.heads, self.kv_heads, self.head_dim,
                                  inner.layers[0].mlp.gate_proj.out_features, inner.norm.weight.data_ptr(),
                                  layers.data_ptr()], dtype=torch.int64)
            self._tables, self._generation = (model, layers), kernels.bind_generation()
        return self._tables[0].data_ptr()

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache: RaggedCache, keep: torch.Tensor,
                 aux: tuple[int, ...] = ()):
        inner = self.inner
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, positions)
        cos, sin, h = cos.contiguous(), sin.contiguous(), h.contiguous()
        n, sessions = ids.shape[1], len(cache.caches)
        kv, past, buffers = [], [], []
        for layer_idx in range(self.layers):
            for c, new in zip(cache.caches, cache.new):
                length, (keys, values) = cache_room(c.layers[layer_idx], self._like, new)
                kv += (keys.data_ptr(), values.data_ptr(), keys.shape[-2])
                buffers.append((c.layers[layer_idx], keys, values, length + new))
                if layer_idx == 0:
                    past.append(length)
        kv_table = torch.tensor(kv, dtype=torch.int64)
        rows = torch.tensor(cache.new + past, dtype=torch.int64)
        aux_layers = torch.tensor(aux, dtype=torch.int64)
        features = h.new_empty(n, len(aux) * h.shape[-1]) if aux else None
        rc = self._decoder(self._model_table(), h.data_ptr(), n, cos.data_ptr(), sin.data_ptr(), sessions,
                           rows.data_ptr(), rows.data_ptr() + 8 * sessions, kv_table.data_ptr(), self.eps, self.scaling,
                           torch.get_num_threads(), len(aux), aux_layers.data_ptr() if aux else None,
                           features.data_ptr() if aux else None)
        if rc != 0:
            raise MemoryError("the native decoder pass found no scratch memory")
        for layer, keys, values, length in buffers:
            layer.keys, layer.values = keys[..., :length, :], values[..., :length, :]
        logits = self.model.lm_head(h[:, keep, :])
        return (logits, features) if aux else logits

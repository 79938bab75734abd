"""EAGLE-3 feature heads: a draft of one decoder layer fed with the target's own hidden states.

A head (Li et al. 2025, arXiv 2503.01840) drafts token j + 1 from the embedding of token j and a
feature of position j - 1: for tokens the target has run, the residual stream entering three of
its layers (`feature_layers`: the head config's `eagle_aux_hidden_state_layer_ids`, else vLLM's
default (2, L // 2, L - 3)) concatenated and projected by `fc`; for the head's own proposals, the
state its layer computed at the previous position (before the final norm). One layer's weights
instead of a whole model's: a step costs a small fraction of a target pass.

Loaded from a directory in the layout vLLM's `llama_eagle3.py` and SGLang load:
  config.json    LlamaForCausalLMEagle3-style (hidden_size, intermediate_size, heads,
                 draft_vocab_size, optional target_hidden_size, eagle_config.
                 eagle_aux_hidden_state_layer_ids, norm_before_residual), or the speculators
                 variant (speculators_model_type "eagle3", its transformer_layer_config)
  *.safetensors  fc.weight [d, 3 d_target]; midlayer.* (or layers.0.*): input_layernorm,
                 hidden_norm, post_attention_layernorm, self_attn.{q,k,v}_proj over 2 d (the normed
                 embedding and the normed feature side by side), o_proj, mlp.{gate,up,down}_proj;
                 norm; lm_head [draft_vocab, d]; d2t (target id = draft id + d2t[id]); optional
                 embed_tokens (else the target's) and t2d (unused). Two extensions of this project
                 (specdec train-head writes them): a head without lm_head scores with the target's
                 own output rows of its draft vocabulary, and a Linear stored as int8 rows
                 (NAME.weight int8 [out, in] with NAME.weight_scale [out, 1]) is their product

The head scores only its draft vocabulary: its q is the softmax over those ids, zero elsewhere
(logits -inf there), so rejection sampling against the target stays exact whatever the head.

Token 0 has no feature before it: as in vLLM, no later position attends to it (its entry exists
so that positions and cache lengths stay those of the session's tokens). This module owns the
head's weights and its forward; sessions are specdec/worker/sessions.py's, passes specdec/worker/runner.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specdec.worker.batching import RaggedCache


@dataclass(frozen=True)
class HeadConfig:
    """What a head directory's config.json says, in one shape for both layouts."""

    hidden_size: int
    intermediate_size: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_norm_eps: float
    draft_vocab_size: int
    target_hidden_size: int | None  # None: the head's own hidden_size
    feature_layers: tuple[int, ...] | None  # None: the target's default (2, L // 2, L - 3)
    norm_before_residual: bool
    llama: dict  # the Llama config the rotary embedding and the KV cache are built from


def is_head_dir(path: str | Path) -> bool:
    """Whether `path` is a directory holding an EAGLE-3 head (either layout)."""
    config = Path(path).expanduser() / "config.json"
    if not config.is_file():
        return False
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return _is_head(raw)


def _is_head(raw: dict) -> bool:
    archs = raw.get("architectures") or []
    return (raw.get("speculators_model_type") == "eagle3" or any("Eagle3" in a for a in archs)
            or "draft_vocab_size" in raw and "eagle_config" in raw)


def read_head_config(path: Path) -> HeadConfig:
    raw = json.loads((path / "config.json").read_text())
    if not _is_head(raw):
        raise ValueError(f"{path} holds no EAGLE-3 head (config.json names neither an Eagle3 architecture nor "
                         f"speculators_model_type eagle3)")
    layer = raw.get("transformer_layer_config") or raw  # speculators: the layer's config nested
    d = int(layer["hidden_size"])
    heads = int(layer["num_attention_heads"])
    eagle = raw.get("eagle_config") or {}
    aux = eagle.get("eagle_aux_hidden_state_layer_ids") or raw.get("eagle_aux_hidden_state_layer_ids")
    llama = {k: v for k, v in layer.items() if k not in ("architectures", "model_type", "num_hidden_layers",
                                                         "vocab_size", "torch_dtype", "dtype")}
    return HeadConfig(
        hidden_size=d, intermediate_size=int(layer["intermediate_size"]), heads=heads,
        kv_heads=int(layer.get("num_key_value_heads") or heads), head_dim=int(layer.get("head_dim") or d // heads),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer.get("draft_vocab_size") or layer["vocab_size"]),
        target_hidden_size=int(raw["target_hidden_size"]) if raw.get("target_hidden_size") else None,
        feature_layers=tuple(int(i) for i in aux) if aux else None,
        norm_before_residual=bool(raw.get("norm_before_residual", layer.get("norm_before_residual", False))),
        llama=llama)


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default aux layers for a target of num_layers decoder layers."""
    return (2, num_layers // 2, num_layers - 3)


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Eagle3Head(nn.Module):
    """The head's weights. `config` is a one-layer LlamaConfig over the target's vocabulary: what a
    worker's KV caches and max context are built from. `draft_ids` [draft_vocab]: the target id of
    each of the head's output rows."""

    def __init__(self, hc: HeadConfig, vocab_size: int, feature_layers: tuple[int, ...], target_hidden: int,
                 max_context: int):
        super().__init__()
        self.head_config, self.feature_layers = hc, feature_layers
        d, kv = hc.hidden_size, hc.kv_heads * hc.head_dim
        self.config = LlamaConfig(**{**hc.llama, "num_hidden_layers": 1, "vocab_size": vocab_size,
                                     "max_position_embeddings": max_context, "head_dim": hc.head_dim,
                                     "num_key_value_heads": hc.kv_heads})
        self.embed_tokens = nn.Embedding(vocab_size, d)
        self.fc = nn.Linear(len(feature_layers) * target_hidden, d, bias=False)
        self.input_layernorm = _RMSNorm(d, hc.rms_norm_eps)
        self.hidden_norm = _RMSNorm(d, hc.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(d, hc.rms_norm_eps)
        bias = bool(hc.llama.get("attention_bias", False))
        self.q_proj = nn.Linear(2 * d, hc.heads * hc.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * d, kv, bias=bias)
        self.v_proj = nn.Linear(2 * d, kv, bias=bias)
        self.o_proj = nn.Linear(hc.heads * hc.head_dim, d, bias=bias)
        self.gate_proj = nn.Linear(d, hc.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, hc.intermediate_size, bias=False)
        self.down_proj = nn.Linear(hc.intermediate_size, d, bias=False)
        self.norm = _RMSNorm(d, hc.rms_norm_eps)
        self.lm_head = nn.Linear(d, hc.draft_vocab_size, bias=False)
        self.register_buffer("draft_ids", torch.arange(hc.draft_vocab_size), persistent=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.config)

    @property
    def feature_size(self) -> int:
        return self.fc.in_features

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens


def _own_name(name: str) -> str | None:
    """A checkpoint tensor's name in Eagle3Head (its one layer's names flattened), or None for t2d,
    which it does not use; a second layer keeps its "layers." prefix (refused by load_head)."""
    for prefix in ("model.", "midlayer.", "layers.0."):
        name = name.removeprefix(prefix)
    if name == "t2d":
        return None
    return name if name.startswith("layers.") else name.replace("self_attn.", "").replace("mlp.", "")


def load_head(path: Path, *, vocab_size: int, target_layers: int, target_hidden: int, target_embedding,
              max_context: int, dtype: torch.dtype, device: str = "cpu", target_output=None) -> Eagle3Head:
    """The head at `path` for a target of `target_layers` layers of width `target_hidden` and
    vocabulary `vocab_size`. target_embedding: a callable giving the target's input embedding
    [vocab, target_hidden], asked only when the head ships none; target_output: a callable giving
    the target's output rows [len(ids), target_hidden] of target ids, asked only when the head has
    no lm_head. ValueError where the head does not fit the target (its aux layers, its feature
    width, its vocabulary)."""
    from safetensors.torch import load_file

    hc = read_head_config(path)
    layers = hc.feature_layers or default_feature_layers(target_layers)
    if any(not 0 <= i < target_layers for i in layers):
        raise ValueError(f"head {path.name} reads the target's layers {list(layers)}, but the target has "
                         f"{target_layers} layers")
    expected_hidden = hc.target_hidden_size or hc.hidden_size
    if expected_hidden != target_hidden:
        raise ValueError(f"head {path.name} was made for a target of hidden size {expected_hidden}; this target's "
                         f"is {target_hidden}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"head {path.name} has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for name, tensor in load_file(str(f)).items():
            own = _own_name(name)
            if own is not None:
                state[own] = tensor
    for name in [n for n in state if n.endswith(".weight_scale")]:  # int8 rows: weight * scale
        scale, base = state.pop(name), name.removesuffix("_scale")
        if base not in state or state[base].dtype != torch.int8 or scale.shape != (state[base].shape[0], 1):
            raise ValueError(f"head {path.name}: {name} has no int8 weight [{scale.shape[0]}, in] beside it")
        state[base] = state[base].float() * scale.float()
    extra_layers = sorted({k.split(".")[1] for k in state if k.startswith("layers.")})
    if extra_layers:
        raise ValueError(f"head {path.name} has {len(extra_layers) + 1} decoder layers; one is served")
    head = Eagle3Head(hc, vocab_size, tuple(layers), target_hidden, max_context)
    d2t = state.pop("d2t", None)
    if d2t is not None:
        ids = torch.arange(hc.draft_vocab_size) + d2t.long()
    elif hc.draft_vocab_size == vocab_size:
        ids = torch.arange(vocab_size)
    else:
        raise ValueError(f"head {path.name} scores {hc.draft_vocab_size} tokens but has no d2t to map them to the "
                         f"target's {vocab_size}")
    if ids.numel() != hc.draft_vocab_size or int(ids.min()) < 0 or int(ids.max()) >= vocab_size \
            or torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"head {path.name}: d2t maps its {hc.draft_vocab_size} tokens outside the target's "
                         f"vocabulary of {vocab_size} (or twice onto one id)")
    if "embed_tokens.weight" not in state:
        embedding = target_embedding()
        if embedding.shape != (vocab_size, hc.hidden_size):
            raise ValueError(f"head {path.name} has no embedding and the target's is {tuple(embedding.shape)}, not "
                             f"[{vocab_size}, {hc.hidden_size}]")
        state["embed_tokens.weight"] = embedding
    if "lm_head.weight" not in state:
        if target_output is None:
            raise ValueError(f"head {path.name} has no lm_head (it scores with the target's output rows) and no "
                             f"target to take them from")
        state["lm_head.weight"] = target_output(ids)
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "draft_ids"]
    if missing or unexpected:
        raise ValueError(f"head {path.name}: weights missing {missing}, unexpected {unexpected}")
    head.draft_ids = ids
    return head.to(device=device, dtype=dtype).eval()


class HeadForward:
    """The head's pass over a ragged batch: forward(ids [1, n], positions [1, n], cache, keep,
    hidden [n, d]: each token's input state, already through fc where it came from the target) ->
    (logits [1, len(keep), vocab]: -inf off the draft vocabulary, the kept rows' states [len(keep), d]
    to feed the next position)."""

    def __init__(self, head: Eagle3Head):
        self.head = head
        self.scaling = head.head_config.head_dim ** -0.5

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache: RaggedCache, keep: torch.Tensor,
                 hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, hc = self.head, self.head.head_config
        n = ids.shape[1]
        assert hidden.shape == (n, hc.hidden_size), (hidden.shape, n)
        embeds = h.input_layernorm(h.embed_tokens(ids[0]))
        if hc.norm_before_residual:
            hidden = residual = h.hidden_norm(hidden)
        else:
            residual, hidden = hidden, h.hidden_norm(hidden)
        x = torch.cat([embeds, hidden], dim=-1)[None]  # [1, n, 2 d]
        shape = (1, n, -1, hc.head_dim)
        q = h.q_proj(x).view(shape).transpose(1, 2)
        k = h.k_proj(x).view(shape).transpose(1, 2)
        v = h.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = h.rotary_emb(x, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        keys, values = cache.update(k, v, 0)
        out = torch.cat([self._attend(qs, ks, vs, m) for qs, ks, vs, m in
                         zip(q.split(cache.new, dim=2), keys.tensors, values.tensors, cache.new)], dim=2)
        residual = residual + h.o_proj(out.transpose(1, 2).reshape(n, -1))
        x = h.post_attention_layernorm(residual)
        residual = residual + h.down_proj(torch.nn.functional.silu(h.gate_proj(x)) * h.up_proj(x))
        state = residual[keep]  # [keep, d]: fed back as the next position's feature
        scores = h.lm_head(h.norm(state))  # [keep, draft_vocab]
        logits = scores.new_full((len(keep), h.config.vocab_size), float("-inf"))
        logits[:, h.draft_ids] = scores
        return logits[None], state

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, new: int) -> torch.Tensor:
        """One session: q [1, heads, new, hd] against its k, v [1, kv_heads, past + new, hd]; token 0
        is seen by itself only (it has no feature)."""
        total = k.shape[2]
        past = total - new
        sdpa = torch.nn.functional.scaled_dot_product_attention
        gqa = q.shape[1] != k.shape[1]
        if past >= 1 and new == 1:  # a decoding step: every key but token 0's
            return sdpa(q, k[:, :, 1:], v[:, :, 1:], scale=self.scaling, enable_gqa=gqa)
        pos = torch.arange(past, total, device=q.device)[:, None]
        key = torch.arange(total, device=q.device)[None, :]
        mask = (key <= pos) & ((key >= 1) | (pos == 0))
        return sdpa(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=gqa)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

"""Loading a causal LM and its tokenizer for a worker, on a device and in a dtype.

A model spec is a local transformers directory or anything `specdec.model_store` resolves
(a GGUF file, a short name of the default pair, a hub id). `device_map` goes to accelerate so a
model too large for one GPU can be spread over several. This module does not serve anything.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """'auto' is float32 on CPU (fast kernels there) and bfloat16/float16 on accelerators."""
    if name == "auto":
        if device.startswith("cuda") and torch.cuda.is_available():
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}") from None


def resolve_model_dir(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    from specdec import model_store  # heavier: downloads, GGUF conversion

    return model_store.resolve_model(spec)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    path: Path
    device: str
    dtype: torch.dtype


def load_model(spec: str, *, device: str = "cpu", dtype: str = "auto", device_map: str | None = None) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_dir(spec)
    torch_dtype = resolve_dtype(dtype, device)
    kwargs = {"dtype": torch_dtype}
    if device_map:
        kwargs["device_map"] = device_map  # accelerate places the layers
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if not device_map:
        model.to(device)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    name = os.path.basename(os.path.normpath(spec)) if Path(spec).exists() else spec
    return LoadedModel(model, tokenizer, name, path, device, torch_dtype)


def vocab_fingerprint(tokenizer) -> str:
    """sha256 over the tokenizer's (token, id) pairs: equal iff two vocabularies map alike."""
    h = hashlib.sha256()
    for token, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{token}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def eos_token_ids(model, tokenizer) -> list[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is None:
            continue
        ids.update(source if isinstance(source, (list, tuple)) else [source])
    return sorted(int(i) for i in ids)

"""Loading a causal LM and its tokenizer for a worker, on a device and in a dtype.

A model spec is a local transformers directory or anything `specdec.model_store` resolves
(a GGUF file, a short name of the default pair, a hub id). `device_map` goes to accelerate so a
model too large for one GPU can be spread over several. This module does not serve anything.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec import envs

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


QUANTIZATIONS = ("none", "fp16", "int8", "int8-rows", "int4-rows", "q4k-rows")


def resolve_quantization(name: str, device: str, dtype: torch.dtype, role: str = "target") -> str:
    """'auto' on CPU (float32 models): int4-rows for a target where the native kernel builds
    (the source GGUF's Q4_K and Q6_K blocks, int8-rows for every other Linear; plain int8-rows for a
    model with no GGUF behind it: load_model reports which), else int8-rows; for a draft q4k-rows
    where the native kernel builds (else int8); elsewhere none.

    q4k-rows puts every Linear on Q4_K blocks: the source GGUF's own Q4_K and Q6_K where it has
    them, every other one requantized to Q4_K at load (kernels.q4k_quantize, llama.cpp's search; a
    width that is no multiple of 256 padded). A second rounding, so for drafts: the default
    draft's step reads ~240 MB instead of ~390 (int8-rows), which makes its 1- and 2-row steps
    cheaper (a long prefill dearer: compute-bound sooner) and keeps as many of its drafts
    (docs/benchmarks/q4k-draft/).

    int4-rows reads ~0.99 GB a pass of the default target (1.07 with its Q6_K tensors as int8-rows)
    against int8-rows' 1.5 GB, rows as independent (integer sums per 256-column super-block): faster
    where reading the weights is the bound (passes of a few rows, so one client), slower from ~17
    rows, and 1.1 GiB less memory (docs/benchmarks/native-int8/README.md, "The GGUF's own Q4_K blocks").

    A target's rows must be independent (a k-row verify pass computing exactly what k single
    steps compute, or speculative output stops being the target's own): int8-rows is (int8 weights
    per output channel, int8 activations per row, exact integer sums: specdec/kernels.py), and it
    reads half the bytes of fp16 weights, so its passes are faster (`specdec bench kernels`,
    docs/benchmarks/native-int8/), its greedy text within KL ~0.003 of the fp16 path
    (docs/architecture.md, native kernels and quantization). `fp16` (fbgemm's
    fp16-weight kernels, fp32 activations; row-independent on AVX-512 CPUs only:
    kernels.fp16_rows_independent) stays as an option. fbgemm's
    plain `int8` computes one activation scale over all rows of a pass: rows are not independent.

    A draft's numerics never change the output (the target verifies every token; q is what the
    draft really sampled from), so a draft takes whichever kernel is fastest at one row: q4k-rows
    (above) where the native kernel builds, else fbgemm's plain int8, faster at one row than
    int8-rows on fbgemm, whose sentinel row and requantized input cost more
    (docs/benchmarks/native-int8/).
    """
    if name == "auto":
        if device != "cpu" or dtype != torch.float32:
            return "none"
        from specdec.kernels import native_available

        chosen = ("q4k-rows" if role == "draft" else "int4-rows") if native_available() else \
            ("int8" if role == "draft" else "int8-rows")
        if chosen in ("int8", "int8-rows"):  # the fallback changes speed, memory and numerics: say so
            log.warning("--quantize auto: the native kernels cannot run here (they need Linux x86-64 with AVX2 "
                        "and a C compiler, and SPECDEC_NATIVE_KERNELS not 0); the %s runs %s on fbgemm, slower",
                        role, chosen)
        return chosen
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}; choose one of auto, {', '.join(QUANTIZATIONS)}")
    if name != "none" and (device != "cpu" or dtype != torch.float32):
        raise ValueError(f"quantization {name!r} needs --device cpu and a float32 model")
    if name in ("int4-rows", "q4k-rows"):
        from specdec.kernels import native_available

        if not native_available():
            raise ValueError(f"quantization {name!r} needs the native kernel (Linux x86-64 with AVX2, a C "
                             "compiler, SPECDEC_NATIVE_KERNELS not 0)")
    return name


def quantize(model: torch.nn.Module, quantization: str, blocks: dict | None = None) -> torch.nn.Module:
    """Every nn.Linear (CPU only) replaced by a kernel of specdec/kernels.py: int8-rows (int8
    weights, int8 activations per row: rows independent; the native AVX2 kernel where it builds,
    else fbgemm), int4-rows (the Q4_K blocks `blocks` maps Linear names to, from gguf_blocks,
    and int8-rows for the rest), int8 (fbgemm, one activation scale per pass) or fp16 (fbgemm, fp16
    weights, fp32 activations); 'none' returns the model unchanged."""
    if quantization == "none":
        return model
    from specdec.kernels import replace_linears

    with torch.no_grad():
        return replace_linears(model, quantization, blocks)


def gguf_blocks(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """int4-rows: the Q4_K blocks (uint8 rows [N, K / 256 * 144]) of each Linear that the model's
    source GGUF holds in Q4_K, and the Q6_K blocks ([N, K / 256 * 210]) of each it holds in Q6_K
    (SPECDEC_Q6K=0: those stay int8-rows, the ablation), by the Linear's qualified name. The GGUF is the one `source.json`
    (of a directory model_store converted) names, or, where that path is gone, the same file name
    in the cache's gguf/ beside the converted directory (a cache mounted at another path). Each is
    checked against the weight loaded from the store on 16 rows (the blocks' values, rounded to the
    store's dtype, must be its very values): a tensor the conversion changed (permuted,
    requantized) stays int8-rows. {} (logged) where there is no GGUF."""
    import json

    from specdec.kernels import q4k_dequantize, q6k_dequantize

    try:
        source = Path(json.loads((Path(path) / "source.json").read_text())["source_gguf"])
    except (OSError, ValueError, KeyError):
        log.info("int4-rows: %s has no source GGUF (source.json); every Linear runs int8-rows", path)
        return {}
    if not source.is_file():  # the cache mounted elsewhere (another container's path): look beside it
        moved = Path(path).resolve().parent.parent / "gguf" / source.name
        if not moved.is_file():
            log.warning("int4-rows: the source GGUF %s is gone (nor at %s); every Linear runs int8-rows",
                        source, moved)
            return {}
        source = moved
    from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map

    arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == model.config.model_type), None)
    if arch is None:
        log.warning("int4-rows: gguf-py does not know %s's tensor names; every Linear runs int8-rows",
                    model.config.model_type)
        return {}
    tensors = gguf_tensors(source)
    names = get_tensor_name_map(arch, model.config.num_hidden_layers)
    blocks, linears, q6k = {}, 0, 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        linears += 1
        kind, data = tensors.get(names.get_name(f"{name}.weight", try_suffixes=(".weight",)) or "", (None, None))
        dequantize = {GGMLQuantizationType.Q4_K: q4k_dequantize, GGMLQuantizationType.Q6_K: q6k_dequantize}.get(kind)
        if dequantize is None or dequantize is q6k_dequantize and not envs.on("SPECDEC_Q6K"):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only memory map: read, never written
            rows = torch.from_numpy(data)
        weight = module.weight.detach()
        sample = torch.linspace(0, weight.shape[0] - 1, 16).long()
        if rows.shape[0] != weight.shape[0] or not torch.equal(dequantize(rows[sample]).to(weight.dtype),
                                                               weight[sample]):
            log.warning("int4-rows: %s's %s blocks are not the weights the store holds; it runs int8-rows", name,
                        kind.name)
            continue
        blocks[name] = rows
        q6k += dequantize is q6k_dequantize
    log.info("int4-rows: %d of %d Linears from the GGUF's own blocks (%d Q4_K, %d Q6_K), the rest int8-rows",
             len(blocks), linears, len(blocks) - q6k, q6k)
    return blocks


def gguf_tensors(path: Path) -> dict:
    """A GGUF file's tensors by name: (GGMLQuantizationType, its data as a read-only uint8 memory
    map of [rows, bytes a row] for a block format, as gguf-py's GGUFReader gives it). Only the
    header is walked, its metadata skipped, not parsed: GGUFReader builds every field (the
    tokenizer's 151k tokens and merges), seconds of each default model's load on 2 cores
    (docs/benchmarks/model-store/)."""
    import struct

    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

    scalar_bytes = {kind: np.dtype(t).itemsize for kind, t in GGUFReader.gguf_scalar_to_np.items()}
    data = np.memmap(path, dtype=np.uint8, mode="r")
    view = memoryview(data)
    if bytes(view[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    at = 8
    count, kvs = struct.unpack_from("<QQ", view, at)
    at += 16
    alignment = 32

    def string(at: int) -> tuple[str, int]:
        n = struct.unpack_from("<Q", view, at)[0]
        return bytes(view[at + 8:at + 8 + n]).decode("utf-8"), at + 8 + n

    def skip(kind: int, at: int) -> int:  # past one value of the type
        if kind == GGUFValueType.STRING:
            return at + 8 + struct.unpack_from("<Q", view, at)[0]
        if kind == GGUFValueType.ARRAY:
            item, n = struct.unpack_from("<IQ", view, at)
            at += 12
            if item in scalar_bytes:
                return at + n * scalar_bytes[item]
            for _ in range(n):
                at = skip(item, at)
            return at
        return at + scalar_bytes[kind]

    for _ in range(kvs):
        key, at = string(at)
        kind = struct.unpack_from("<I", view, at)[0]
        if key == "general.alignment" and kind == GGUFValueType.UINT32:
            alignment = struct.unpack_from("<I", view, at + 4)[0]
        at = skip(kind, at + 4)
    infos = []
    for _ in range(count):
        name, at = string(at)
        dims = struct.unpack_from("<I", view, at)[0]
        shape = struct.unpack_from(f"<{dims}Q", view, at + 4)
        kind, offset = struct.unpack_from("<IQ", view, at + 4 + 8 * dims)
        at += 4 + 8 * dims + 12
        infos.append((name, shape, GGMLQuantizationType(kind), offset))
    start = -(-at // alignment) * alignment
    tensors = {}
    for name, shape, kind, offset in infos:
        block, size = GGML_QUANT_SIZES[kind]
        row = shape[0] // block * size  # GGUF's first dimension is a row's
        rows = int(np.prod(shape[1:], dtype=np.int64))
        tensors[name] = (kind, data[start + offset:start + offset + rows * row].reshape(rows, row))
    return tensors


Q4K_CACHE_VERSION = 1  # bump whenever kernels.q4k_quantize would write other blocks


def requantized_blocks(path: Path, model: torch.nn.Module, have: dict) -> dict[str, torch.Tensor]:
    """q4k-rows: Q4_K blocks (kernels.q4k_quantize) for every CPU Linear of the model that `have`
    (its GGUF's own blocks, gguf_blocks) does not hold. Requantizing the default draft takes ~14 s
    on 2 cores, so for a model the store converted (under the cache root) the blocks are kept under
    <cache root>/q4k/, one file per model, named by what they were made from: its directory, its
    safetensors files' names, sizes and times, the Linears' names and shapes (a restricted head has
    its own), Q4K_CACHE_VERSION. A later load of the same model reads them back. Any other model
    directory, or a cache that cannot be written, just computes them (logged)."""
    import json

    from specdec.kernels import q4k_quantize
    from specdec.model_store import cache_root

    todo = [(name, m) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m.weight.device.type == "cpu" and name not in have]
    if not todo:
        return {}
    root = cache_root().resolve()
    stored = Path(path).resolve().is_relative_to(root)
    files = sorted(Path(path).glob("*.safetensors")) if stored else []
    key = hashlib.sha256(json.dumps({
        "version": Q4K_CACHE_VERSION, "store": str(Path(path).resolve()),
        "files": [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files],
        "linears": [(name, list(m.weight.shape)) for name, m in todo]}).encode()).hexdigest()[:32]
    cached = root / "q4k" / f"{key}.safetensors"
    if files and cached.is_file():
        from safetensors.torch import load_file

        try:
            blocks = load_file(cached)
            if set(blocks) == {name for name, _ in todo}:
                log.info("q4k-rows: %d Linears' Q4_K blocks read from %s", len(blocks), cached)
                return blocks
        except Exception as exc:  # noqa: BLE001 - a damaged file: computed again and replaced
            log.warning("q4k-rows: cannot read %s (%s); requantizing", cached, exc)
    blocks = {name: q4k_quantize(m.weight.detach()) for name, m in todo}
    if files:
        from safetensors.torch import save_file

        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            partial = cached.with_suffix(f".{os.getpid()}.tmp")
            save_file(blocks, str(partial))
            os.replace(partial, cached)  # whole or not at all, whoever else writes it
            log.info("q4k-rows: %d Linears requantized to Q4_K, kept in %s", len(blocks), cached)
        except OSError as exc:
            log.info("q4k-rows: %d Linears requantized to Q4_K (not kept: %s)", len(blocks), exc)
    return blocks


def _stored_dtype(path: Path) -> str | None:
    import json

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("dtype") or config.get("torch_dtype")


def own_memory(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Copies every CPU tensor the model still shares with its weight files into memory of its
    own, in `dtype` if it is floating, one tensor at a time, so the files' mappings close.

    transformers maps safetensors files and, where the stored dtype is the one asked for, hands
    out tensors that live in the mapping: the pages read stay in the process's RSS (gigabytes of
    a target's file) even where quantization replaced the Linear weights. A container's memory
    limit should not have to cover a file the worker no longer reads. A kernel's module (specdec/kernels.py) made its
    tensors itself, its weights on huge pages: they stay where they are."""
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "owns_memory", False):
                continue
            for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if tensor is not None and tensor.device.type == "cpu":
                    tensor.data = tensor.data.to(dtype, copy=True) if tensor.is_floating_point() \
                        else tensor.data.clone()


def restrict_output_head(model: torch.nn.Module, rows: int) -> None:
    """Keeps the first `rows` rows of the output head (FR-Spec style, for a draft).

    Token ids of a BPE vocabulary are roughly ordered by merge frequency, so the first rows are
    the common tokens. The draft then proposes only from them, with q defined on that subset;
    the rejection test stays exact (tokens outside have q = 0 and are reached via the residual).
    """
    head = model.get_output_embeddings()
    if rows <= 0 or rows >= head.weight.shape[0]:
        return
    small = torch.nn.Linear(head.in_features, rows, bias=head.bias is not None, dtype=head.weight.dtype,
                            device=head.weight.device)
    with torch.no_grad():
        small.weight.copy_(head.weight[:rows])
        if head.bias is not None:
            small.bias.copy_(head.bias[:rows])
    model.set_output_embeddings(small)


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
    quantization: str = "none"
    head_rows: int = 0  # 0: the full output head


def load_model(
    spec: str,
    *,
    device: str = "cpu",
    dtype: str = "auto",
    device_map: str | None = None,
    quantization: str = "auto",
    head_rows: int = 0,
    role: str = "target",
    target_model: str | None = None,
) -> LoadedModel:
    """role: 'draft' or 'target' (what 'auto' quantization picks on CPU). A draft spec naming an
    EAGLE-3 head directory (specdec/eagle3.py) needs target_model: the head drafts for it, with
    its tokenizer and (unless the head ships one) its input embedding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.eagle3 import is_head_dir
    from specdec.model_store import shipped_head

    spec = str(shipped_head(spec) or spec)
    if is_head_dir(spec):
        if head_rows:
            log.warning("--draft-vocab %d ignored: a feature head scores its own draft vocabulary (its d2t)", head_rows)
        return load_head_model(spec, target_model, device=device, dtype=dtype, quantization=quantization)
    path = resolve_model_dir(spec)
    torch_dtype = resolve_dtype(dtype, device)
    quantization = resolve_quantization(quantization, device, torch_dtype, role)
    load_dtype = torch_dtype
    if quantization in ("fp16", "int8", "int8-rows", "int4-rows", "q4k-rows") and not device_map and _stored_dtype(path) == "float16":
        # Linear weights quantized straight from the float16 store, never a float32 copy of
        # them all at once (one matrix at a time): the same model to the bit
        # (tests/specdec/test_modeling.py), with a lower load peak than a float32 copy of every
        # weight. The rest is upcast to float32 below
        load_dtype = torch.float16
    kwargs = {"dtype": load_dtype}
    if device_map:
        kwargs["device_map"] = device_map  # accelerate places the layers
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if not device_map:
        model.to(device)
    model.eval()
    if head_rows:
        restrict_output_head(model, head_rows)
    blocks = gguf_blocks(path, model) if quantization in ("int4-rows", "q4k-rows") else None
    if quantization == "q4k-rows":
        blocks.update(requantized_blocks(path, model, blocks))
    if quantization == "int4-rows" and not blocks:
        quantization = "int8-rows"  # what int4-rows is without GGUF blocks: say so (ModelInfo, logs)
    quantize(model, quantization, blocks)
    if quantization == "fp16" and role == "target":
        from specdec.kernels import fp16_rows_independent

        if not fp16_rows_independent():
            log.warning("--quantize fp16: fbgemm's fp16 GEMM is not row-independent on this CPU (no AVX-512), so "
                        "a verify pass is not bitwise k single steps and speculative greedy output can differ "
                        "from gamma 0 on near-ties; int8-rows is exact here")
    if not device_map and device == "cpu":
        own_memory(model, torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    name = os.path.basename(os.path.normpath(spec)) if Path(spec).exists() else spec
    return LoadedModel(model, tokenizer, name, path, device, torch_dtype, quantization, head_rows)


def load_head_model(spec: str, target_model: str | None, *, device: str, dtype: str,
                    quantization: str = "auto") -> LoadedModel:
    """An EAGLE-3 head for target_model, with the target's tokenizer; ValueError where it does not
    fit the target. Its Linears (fc, the layer's projections, lm_head) are quantized as a model
    draft's are: 'auto' on CPU is q4k-rows where the native kernel builds (the cheapest head step
    on the default target's shape, docs/benchmarks/feature-heads), else int8."""
    from transformers import AutoConfig, AutoTokenizer

    from specdec.eagle3 import load_head

    if not target_model:
        raise ValueError(f"{spec} is an EAGLE-3 feature head: name the target it drafts for (--target-model)")
    target_path = resolve_model_dir(target_model)
    config = AutoConfig.from_pretrained(target_path).get_text_config(decoder=True)
    torch_dtype = resolve_dtype(dtype, device)
    head = load_head(Path(spec).expanduser(), vocab_size=int(config.vocab_size),
                     target_layers=int(config.num_hidden_layers), target_hidden=int(config.hidden_size),
                     target_embedding=lambda: target_embedding(target_path),
                     target_output=lambda ids: target_output_rows(target_path, ids),
                     max_context=int(getattr(config, "max_position_embeddings", 0) or 2048), dtype=torch_dtype,
                     device=device)
    quantization = resolve_quantization(quantization, device, torch_dtype, "draft")
    blocks = requantized_blocks(Path(spec), head, {}) if quantization == "q4k-rows" else None
    quantize(head, quantization, blocks)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    name = os.path.basename(os.path.normpath(spec))
    log.info("feature head %s for %s: reads layers %s, scores %d tokens", name, target_model,
             list(head.feature_layers), head.lm_head.out_features)
    return LoadedModel(head, tokenizer, name, Path(spec), device, torch_dtype, quantization)


def target_embedding(path: Path) -> torch.Tensor:
    """A model directory's input embedding [vocab, hidden], read from its safetensors alone where it
    has them (no other weight loaded), else from the whole model."""
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight"):
                if key in st.keys():
                    return st.get_tensor(key).float()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).get_input_embeddings().weight.detach()


def target_output_rows(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """A model directory's output-head rows [len(ids), hidden] (float32) of token ids, read from its
    safetensors alone where it has them (its input embedding's rows where the two are tied)."""
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in ("lm_head.weight", "model.language_model.lm_head.weight"):
                if key in st.keys():
                    return st.get_slice(key)[:][ids].float()
    from transformers import AutoConfig

    if getattr(AutoConfig.from_pretrained(path).get_text_config(decoder=True), "tie_word_embeddings", False):
        return target_embedding(path)[ids].float()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).lm_head.weight.detach()[ids].clone()


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

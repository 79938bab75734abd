"""Loading a worker's model: nothing stays mapped from its weight files once it is loaded."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from specdec.modeling import load_model
from specdec_tools.testing.tiny_models import build_model_dir


def mapped(directory: Path) -> list[str]:
    """The files of `directory` this process has mapped."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return sorted({line.split()[-1] for line in lines if str(directory) in line})


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("fp32") / "m", seed=5, layers=1, dtype=torch.float32)


def test_transformers_alone_keeps_the_weight_file_mapped(fp32_dir):
    """The check below has teeth: loaded as stored, the tensors live in the file's mapping."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fp32_dir, dtype=torch.float32)
    assert any(name.endswith(".safetensors") for name in mapped(fp32_dir))
    del model
    gc.collect()


@pytest.mark.parametrize("quantization", ["none", "fp16", "int8", "int8-rows"])
def test_a_loaded_worker_model_maps_no_weight_file(fp32_dir, quantization):
    loaded = load_model(str(fp32_dir), dtype="float32", quantization=quantization)
    gc.collect()
    assert mapped(fp32_dir) == []
    with torch.inference_mode():  # and it still computes
        assert torch.isfinite(loaded.model(torch.tensor([[1, 2, 3]])).logits).all()


@pytest.fixture(scope="module")
def fp16_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("fp16") / "m", seed=6, layers=2, dtype=torch.float16)


@pytest.mark.parametrize("quantization", ["fp16", "int8", "int8-rows", "none"])
def test_a_float16_store_runs_as_if_loaded_in_float32(fp16_dir, quantization):
    """A float16 store packs fp16 Linear weights straight from the file: the same model, to
    the bit, as loading float32 first; everything else runs in float32; nothing stays mapped."""
    from transformers import AutoModelForCausalLM

    from specdec.modeling import quantize

    loaded = load_model(str(fp16_dir), dtype="float32", quantization=quantization)
    gc.collect()
    assert mapped(fp16_dir) == []
    floats = [t for t in [*loaded.model.parameters(), *loaded.model.buffers()] if t.is_floating_point()]
    assert floats and all(t.dtype == torch.float32 for t in floats)
    reference = quantize(AutoModelForCausalLM.from_pretrained(fp16_dir, dtype=torch.float32).eval(), quantization)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        assert torch.equal(loaded.model(ids).logits, reference(ids).logits)


def test_auto_quantization_says_when_it_falls_back_from_the_native_kernels(monkeypatch, caplog):
    """Without the native kernels `auto` still serves, on fbgemm, and says so: the fallback
    changes speed, memory and numerics. Asked for by name, the native formats refuse instead."""
    import logging

    import pytest
    import torch

    from specdec.modeling import resolve_quantization

    monkeypatch.setenv("SPECDEC_NATIVE_KERNELS", "0")
    with caplog.at_level(logging.WARNING, logger="specdec.modeling"):
        assert resolve_quantization("auto", "cpu", torch.float32, role="target") == "int8-rows"
        assert resolve_quantization("auto", "cpu", torch.float32, role="draft") == "int8"
    assert sum("native kernels cannot run here" in r.getMessage() for r in caplog.records) == 2
    for name in ("int4-rows", "q4k-rows"):
        with pytest.raises(ValueError, match="native kernel"):
            resolve_quantization(name, "cpu", torch.float32)

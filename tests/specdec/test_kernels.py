"""CPU kernels whose rows are independent (specdec/kernels.py) and the attention that keeps a
verify pass equal to single steps (specdec/worker/batching.py, ROWWISE_MAX_ROWS).

Exactness here means bitwise: a k-row verify pass must give exactly the logits k one-row steps
give, or speculative greedy output can differ from the target's own step-by-step output.
"""

from __future__ import annotations

import os

import pytest
import torch

from draft_service.engine import DraftEngine
from orchestrator.decoder import SpeculativeDecoder
from specdec.kernels import (Fp16Linear, Int8RowLinear, activation_bits, fp16_rows_independent, native_library,
                             quantize_rows)
from specdec.modeling import load_model
from specdec.protocol import GenerationRequest, SamplingParams
from specdec.wire import VerifyCall
from target_service.engine import TargetEngine

GREEDY = SamplingParams(temperature=0)


BACKENDS = [pytest.param(False, id="fbgemm"),
            pytest.param(True, id="native", marks=pytest.mark.skipif(
                native_library() is None, reason="the native kernel needs Linux x86-64 with AVX2 and a C compiler"))]


@pytest.fixture(scope="module")
def linear():
    torch.manual_seed(0)
    return torch.nn.Linear(256, 384)


@pytest.mark.parametrize("native", BACKENDS)
def test_rows_are_independent_bit_for_bit(linear, native):
    m = Int8RowLinear(linear, native=native)
    assert m.backend == ("native" if native else "fbgemm")
    for rows in (2, 3, 5, 9, 17, 33):
        x = torch.randn(rows, 256) * torch.logspace(-2, 1, rows)[:, None]  # rows of very different scales
        alone = torch.cat([m(x[i:i + 1]) for i in range(rows)])
        assert torch.equal(m(x), alone), rows


def _weights(m: Int8RowLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's int8 weights [N, K] and float32 scales, read back from its backend's store."""
    if m.backend == "fbgemm":
        qw, _ = torch.ops.quantized.linear_unpack(m._packed)
        return qw.int_repr(), qw.q_per_channel_scales().float()
    n, k = m.out_features, m.in_features
    np_, kp = -(-n // 4) * 4, m._columns
    tiles = m._weight.view(np_ // 4, kp // 32, 4, 32).transpose(1, 2).reshape(np_, kp)
    return tiles[:n, :k], m._scale


def _vnni_here() -> bool:
    lib = native_library()
    if lib is None:
        return False
    isa = lib.set_isa("best")
    return isa == "avx512-vnni"


ISAS = [pytest.param("avx2", id="avx2"),
        pytest.param("best", id="vnni", marks=pytest.mark.skipif(not _vnni_here(), reason="no AVX-512 VNNI here"))]


@pytest.fixture(params=ISAS)
def isa(request):
    """The native kernel held to one instruction set for the test (AVX2, or its AVX-512 VNNI path)."""
    lib = native_library()
    if lib is not None:
        lib.set_isa(request.param)
    yield request.param
    if lib is not None:
        lib.set_isa("best")


@pytest.mark.parametrize("native", BACKENDS)
@pytest.mark.parametrize("shape", [(256, 384), (100, 70), (1536, 258)])
def test_the_sums_are_exact_integer_sums(native, shape, isa):
    """The result is the float32 epilogue over exact int32 sums of the int8 weights and the per-row
    int8 activations (fbgemm: its scale for the tensor is 1 and its zero point exact; native: the
    kernel's own sums, any K and N, padded inside)."""
    torch.manual_seed(2)
    linear = torch.nn.Linear(*shape)
    m = Int8RowLinear(linear, native=native)
    x = torch.randn(7, shape[0])
    qw, scales = _weights(m)
    if native:
        assert torch.equal(qw, torch.round(linear.weight / scales[:, None]).clamp(-127, 127).to(torch.int8))
    levels = 127.0 if native or activation_bits() == 8 else 63.0
    q = torch.empty_like(x)
    s = quantize_rows(x, levels, out=q)
    assert torch.equal(q, torch.round(x * (levels / x.abs().amax(1, keepdim=True))))  # integers, half to even
    assert q.abs().max() == levels
    sums = q.double() @ qw.double().t()
    assert (sums.abs() < 2**31).all()
    expected = (sums.float() * scales[None, :]) * s + linear.bias
    assert torch.equal(m(x), expected)


def test_native_activations_use_all_8_bits_without_saturating(isa):
    """Extreme rows and weights (every product 127 x 127, both signs): fbgemm's AVX2 path would
    saturate its int16 pair sums here; the native kernel's |x| x sign-carrying w pairs cannot."""
    if native_library() is None:
        pytest.skip("no native kernel here")
    lin = torch.nn.Linear(96, 8, bias=False)
    lin.weight.data.fill_(1.0)
    lin.weight.data[1::2] = -1.0
    m = Int8RowLinear(lin, native=True)
    x = torch.ones(3, 96)
    x[1] = -1.0
    x[2, ::2] = -1.0
    sums = (x * 127).double() @ (lin.weight.detach() * 127).double().t()  # +-127 x +-127, 96 of them
    assert sums.abs().max() == 127 * 127 * 96
    one = torch.tensor(1.0) / 127.0
    assert torch.equal(m(x), (sums.float() * one) * one)


@pytest.mark.skipif(not _vnni_here(), reason="no AVX-512 VNNI here")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 17])
def test_the_vnni_path_gives_the_avx2_paths_bits(rows):
    """AVX-512 VNNI sums (q + 128) w and takes 128 sum(w) off: the same integers as AVX2's, so the
    same output bits, at every row count its 4-row blocks split differently (1-4, 5, 9, 17)."""
    torch.manual_seed(rows)
    lib = native_library()
    for k, n in [(1536, 260), (70, 9), (896, 4864)]:
        linear = torch.nn.Linear(k, n)
        m = Int8RowLinear(linear, native=True)
        x = torch.randn(rows, k) * 4
        try:
            lib.set_isa("avx2")
            reference = m(x)
            lib.set_isa("best")
            assert torch.equal(m(x), reference)
        finally:
            lib.set_isa("best")


@pytest.mark.parametrize("native", BACKENDS)
def test_close_to_the_float_linear_any_shape_no_bias(native):
    torch.manual_seed(1)
    plain = torch.nn.Linear(128, 64, bias=False).requires_grad_(False)
    m = Int8RowLinear(plain, native=native)
    x = torch.randn(2, 3, 128)
    y = m(x)
    assert y.shape == (2, 3, 64) and m.bias is None
    assert float((y - plain(x)).norm() / plain(x).norm()) < 0.03
    assert torch.equal(m(torch.zeros(1, 128)), torch.zeros(1, 64))  # an all-zero row: no division by zero
    assert m(torch.randn(0, 128)).shape == (0, 64)  # no rows
    assert activation_bits() in (7, 8)


@pytest.fixture(scope="module")
def int8_rows_target(model_dirs):
    return TargetEngine(load_model(str(model_dirs["target"]), dtype="float32", quantization="int8-rows"))


def _bases(v):
    return v.argmax, v.logprob_bases


@pytest.mark.parametrize("k", range(2, 10))
@pytest.mark.parametrize("quantization", ["int8-rows", "fp16"])
def test_a_k_row_verify_equals_k_single_steps(model_dirs, int8_rows_target, quantization, k):
    """Whole model, through the worker's own passes: the argmax and the log-probability at every
    position of a k-row verify are bitwise those of k one-row verifies."""
    if quantization == "fp16" and not fp16_rows_independent():
        pytest.skip("fbgemm's fp16 GEMM is not row-independent on this CPU (AVX2 only): the worker warns")
    engine = int8_rows_target if quantization == "int8-rows" else _fp16_target(model_dirs)
    prompt, drafts = [5, 9, 14, 20, 31, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48][: k - 1]
    engine.open_session("whole", prompt)
    engine.open_session("steps", prompt)
    try:
        whole = engine.verify("whole", len(prompt), [], drafts, GREEDY, top_logprobs=0)
        steps = [engine.verify("steps", len(prompt) - 1, [prompt[-1]], [], GREEDY, top_logprobs=0)]
        for i, d in enumerate(drafts):
            steps.append(engine.verify("steps", len(prompt) + i, [d], [], GREEDY, top_logprobs=0))
        assert whole.argmax == [s.argmax[0] for s in steps]
        assert whole.logprob_bases == [s.logprob_bases[0] for s in steps]
    finally:
        engine.close_session("whole")
        engine.close_session("steps")


_FP16: dict = {}


def test_the_fp16_probe_tells_the_truth():
    """fp16_rows_independent() (what the worker's warning rests on) agrees with the kernel on other
    shapes than its own probe's."""
    torch.manual_seed(4)
    m = Fp16Linear(torch.nn.Linear(192, 320))
    x = torch.randn(9, 192)
    seen = all(torch.equal(m(x[:r]), torch.cat([m(x[i:i + 1]) for i in range(r)])) for r in (2, 3, 9))
    assert seen == fp16_rows_independent()


def _fp16_target(model_dirs):
    if "engine" not in _FP16:
        _FP16["engine"] = TargetEngine(load_model(str(model_dirs["target"]), dtype="float32", quantization="fp16"))
    return _FP16["engine"]


def test_a_session_computes_the_same_alone_and_beside_others(int8_rows_target):
    """Rows of other sessions in the same pass change nothing of a session's result."""
    e = int8_rows_target
    for sid, prompt in (("a", [3, 4, 5, 6]), ("b", [7, 8, 9, 10, 11, 12, 13]), ("alone", [3, 4, 5, 6])):
        e.open_session(sid, prompt)
    try:
        calls = [VerifyCall("a", 4, [], [20, 21, 22], GREEDY, 0), VerifyCall("b", 7, [], [30, 31], GREEDY, 0)]
        together = e.verify_batch(calls)
        alone = e.verify("alone", 4, [], [20, 21, 22], GREEDY, top_logprobs=0)
        assert _bases(together[0]) == _bases(alone)
    finally:
        for sid in ("a", "b", "alone"):
            e.close_session(sid)


def test_speculative_output_equals_gamma_0_on_an_int8_rows_target(int8_rows_target, model_dirs):
    draft = DraftEngine(load_model(str(model_dirs["draft"]), dtype="float32", quantization="int8", role="draft"))
    decoder = SpeculativeDecoder(int8_rows_target, draft, int8_rows_target.tokenizer)
    prompt = [40, 41, 42, 43, 44, 40, 41]
    for kw in (dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=3)):  # greedy, coupled sampling
        ref = decoder.generate(GenerationRequest(token_ids=prompt, max_new_tokens=24, gamma=0, **kw)).token_ids
        for gamma in (1, 3, 6):
            r = decoder.generate(GenerationRequest(token_ids=prompt, max_new_tokens=24, gamma=gamma, **kw))
            assert r.token_ids == ref, (kw, gamma)


def test_a_kernel_that_does_not_build_leaves_int8_rows_on_fbgemm(tmp_path, monkeypatch, caplog):
    """No working C compiler: native_library says why in the log and gives None, and int8-rows
    (the draft's auto choice with it) falls back to fbgemm rather than failing the worker."""
    import specdec.kernels as kernels
    from specdec.modeling import resolve_quantization

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels.native_build, "SOURCE_DIR", tmp_path / "installed")  # none built at install
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    build = kernels.native_library.__wrapped__
    if not (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")):
        pytest.skip("no AVX2 here: the native kernel is never tried")
    with caplog.at_level("WARNING"):
        assert build() is None
    assert "did not build" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-written left behind
    monkeypatch.setattr(kernels, "native_library", build)
    m = Int8RowLinear(torch.nn.Linear(64, 32))
    assert m.backend == "fbgemm"
    assert resolve_quantization("auto", "cpu", torch.float32, role="draft") == "int8"
    assert resolve_quantization("auto", "cpu", torch.float32, role="target") == "int8-rows"


def test_the_native_kernel_is_built_once_and_reused(tmp_path, monkeypatch):
    if native_library() is None:
        pytest.skip("no native kernel here")
    import specdec.kernels as kernels

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels.native_build, "SOURCE_DIR", tmp_path / "installed")  # none built at install
    kernels.native_library.__wrapped__()
    built = list((tmp_path / "kernels").glob("int8_rows-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setenv("CC", "false")  # a rebuild would fail now
    assert kernels.native_library.__wrapped__() is not None
    assert built[0].stat().st_mtime_ns == stamp


def test_a_library_built_at_install_is_loaded_and_nothing_compiled(tmp_path, monkeypatch):
    """setup.py builds the library beside the sources; a worker loads that one, compiling nothing."""
    if native_library() is None:
        pytest.skip("no native kernel here")
    import specdec.kernels as kernels

    installed = tmp_path / "installed"
    assert kernels.native_build.build(installed) is not None  # as setup.py's build_py does
    monkeypatch.setattr(kernels.native_build, "SOURCE_DIR", installed)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "false")  # compiling would fail now
    assert kernels.native_library.__wrapped__() is not None
    assert not (tmp_path / "cache").exists()


# ---- int4-rows: the GGUF's own Q4_K blocks -------------------------------------------------------

needs_native = pytest.mark.skipif(native_library() is None, reason="int4-rows needs the native kernel")


FORMATS = ["Q4_K", "Q6_K"]  # the GGUF block formats int4-rows runs on


def _random_blocks(fmt, n, k, g):
    from specdec_tools.testing.tiny_models import random_q4k_blocks, random_q6k_blocks

    return (random_q4k_blocks if fmt == "Q4_K" else random_q6k_blocks)(n, k, g)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gguf_blocks_dequantize_as_gguf_py_does(fmt):
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from specdec.kernels import q4k_dequantize, q6k_dequantize

    blocks = _random_blocks(fmt, 24, 512, torch.Generator().manual_seed(0))
    expected = dequantize(np.ascontiguousarray(blocks.numpy()), GGMLQuantizationType[fmt])
    ours = q4k_dequantize if fmt == "Q4_K" else q6k_dequantize
    assert torch.equal(ours(blocks), torch.from_numpy(expected).float())


def _block_linear(fmt, k, n, seed=1):
    """A Q4KRowLinear or Q6KRowLinear on random blocks, with a bias; and the blocks' float weights."""
    from specdec.kernels import Q4KRowLinear, Q6KRowLinear, q4k_dequantize, q6k_dequantize

    g = torch.Generator().manual_seed(seed)
    blocks = _random_blocks(fmt, n, k, g)
    module, dequantize = (Q4KRowLinear, q4k_dequantize) if fmt == "Q4_K" else (Q6KRowLinear, q6k_dequantize)
    return module(k, n, blocks, torch.randn(n, generator=g)), dequantize(blocks)


@needs_native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(256, 48), (512, 130), (1536, 7)])
def test_int4_rows_are_independent_and_compute_the_formula(fmt, shape, isa):
    """Rows bitwise independent; the result is the rows' int8 integers times the blocks' weights
    (integer sums: exact but for the float steps); close to the float product."""
    k, n = shape
    m, w = _block_linear(fmt, k, n)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2)) * torch.logspace(-2, 1, 9)[:, None]
    y = m(x)
    for rows in (2, 3, 4, 5, 8, 9):  # row blocks of 4 (8 on the VNNI path) and their remainders
        assert torch.equal(m(x[:rows]), torch.cat([m(x[i:i + 1]) for i in range(rows)])), rows
    amax = x.abs().amax(1, keepdim=True)
    q = torch.round(x * (127.0 / amax))  # the rows' int8 activations, as quantize_rows makes them
    expected = (q.double() @ w.double().t()) * (amax.double() / 127) + m.bias.double()
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    exact = x @ w.t() + m.bias
    assert float((y - exact).norm() / exact.norm()) < 0.05  # the weights are the blocks'; activations 8-bit
    assert m(torch.randn(0, k)).shape == (0, n)


@needs_native
@pytest.mark.parametrize("fmt", FORMATS)
def test_int4_rows_vnni_path_gives_the_avx2_paths_bits(fmt):
    lib = native_library()
    if lib.set_isa("best") != "avx512-vnni":
        pytest.skip("this CPU has no AVX-512 VNNI")
    m, _ = _block_linear(fmt, 1536, 96)
    x = torch.randn(13, 1536, generator=torch.Generator().manual_seed(3)) * 3
    try:
        lib.set_isa("avx2")
        avx2 = m(x)
    finally:
        lib.set_isa("best")
    assert torch.equal(m(x), avx2)


@needs_native
def test_int4_rows_refuses_blocks_of_another_shape():
    from specdec.kernels import Q4KRowLinear, Q6KRowLinear

    g = torch.Generator().manual_seed(0)
    for module, fmt, other in ((Q4KRowLinear, "Q4_K", "Q6_K"), (Q6KRowLinear, "Q6_K", "Q4_K")):
        blocks = _random_blocks(fmt, 8, 256, g)
        for k in (512, 600):  # another width (600 columns would need three blocks a row)
            with pytest.raises(ValueError, match="do not hold"):
                module(k, 8, blocks)
        with pytest.raises(ValueError, match="do not hold"):  # the other format's blocks
            module(256, 8, _random_blocks(other, 8, 256, g))


def test_q4k_quantize_writes_blocks_that_hold_the_weights():
    """q4k_quantize's blocks, read back as gguf-py reads a GGUF's: within Q4_K's error of Gaussian
    weights (a wrong scale, offset or nibble order is off by ~the weights), the sub-blocks past K
    zero (in the one K ends in, the padding takes whatever level is nearest zero: the kernel's
    activations there are zero), an all-zero sub-block exact, a constant one within its 6-bit
    scale's step, and better than the plain min/max grid."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from specdec.kernels import _affine_4bit, q4k_quantize

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 600, generator=g) * 0.05
    w[3, :32] = 0.0
    w[4, 32:64] = 0.02
    blocks = q4k_quantize(w.half(), chunk=16)  # float16 in, as a store holds it: converted per chunk
    assert blocks.shape == (64, 3 * 144) and blocks.dtype == torch.uint8
    back = torch.from_numpy(dequantize(np.ascontiguousarray(blocks.numpy()), GGMLQuantizationType.Q4_K)).float()
    assert torch.equal(back[:, 608:], torch.zeros(64, 160))
    back = back[:, :600]
    assert torch.equal(back[3, :32], torch.zeros(32))
    assert torch.allclose(back[4, 32:64], w.half().float()[4, 32:64], rtol=0.05)
    searched = float((back - w).norm() / w.norm())
    assert searched < 0.08
    gaussian = w[5:, :512]
    scale, offset = _affine_4bit(gaussian.reshape(-1, 32), steps=0)  # the min/max grid only
    u = ((gaussian.reshape(-1, 32) + offset[:, None]) / scale[:, None]).round().clamp(0, 15)
    plain = float(((u * scale[:, None] - offset[:, None]).reshape(gaussian.shape) - gaussian).norm() / gaussian.norm())
    assert float((back[5:, :512] - gaussian).norm() / gaussian.norm()) < plain


@needs_native
def test_a_width_that_is_no_multiple_of_256_runs_on_padded_blocks(isa):
    """q4k-rows' Linears of any width: the blocks cover the next multiple of 256 columns, the
    kernel pads each row with zeros; rows stay bitwise independent and the result is the formula
    on the real columns."""
    from specdec.kernels import Q4KRowLinear, q4k_dequantize, q4k_quantize

    g = torch.Generator().manual_seed(4)
    k, n = 200, 40
    blocks = q4k_quantize(torch.randn(n, k, generator=g) * 0.1)
    m = Q4KRowLinear(k, n, blocks, torch.randn(n, generator=g))
    w = q4k_dequantize(blocks)[:, :k]
    x = torch.randn(9, k, generator=g) * torch.logspace(-2, 1, 9)[:, None]
    y = m(x)
    assert torch.equal(y, torch.cat([m(x[i:i + 1]) for i in range(9)]))
    amax = x.abs().amax(1, keepdim=True)
    expected = (torch.round(x * (127.0 / amax)).double() @ w.double().t()) * (amax.double() / 127) + m.bias.double()
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@needs_native
def test_q4k_rows_puts_every_linear_on_blocks_the_ggufs_own_where_it_has_them(gguf_dir, model_dirs):
    from specdec.kernels import Q4KRowLinear, Q6KRowLinear
    from specdec_tools.testing.tiny_models import GGUF_Q6K

    loaded = load_model(str(gguf_dir), quantization="q4k-rows", role="draft")
    assert loaded.quantization == "q4k-rows"
    model = loaded.model
    int4 = _int4_target(gguf_dir).loaded.model
    kinds = {name: type(mod).__name__ for name, mod in model.named_modules()
             if isinstance(mod, (Q4KRowLinear, Q6KRowLinear, Int8RowLinear, torch.nn.Linear))}
    assert kinds.pop("lm_head") == "Q4KRowLinear"  # not in the GGUF: quantized here
    assert kinds.pop("model.layers.1.mlp.up_proj") == "Q4KRowLinear"  # the GGUF's blocks are not the store's
    assert all(kinds.pop(name) == "Q6KRowLinear" for name in GGUF_Q6K)
    assert len(kinds) == 11 and set(kinds.values()) == {"Q4KRowLinear"}
    for name in ("model.layers.0.mlp.gate_proj", *GGUF_Q6K):  # the GGUF's blocks, as int4-rows takes them
        assert torch.equal(model.get_submodule(name)._qs, int4.get_submodule(name)._qs), name
    plain = load_model(str(model_dirs["draft"]), quantization="q4k-rows", role="draft")  # no GGUF behind it
    assert plain.quantization == "q4k-rows"
    assert all(isinstance(m, Q4KRowLinear) for m in plain.model.modules()
               if isinstance(m, (torch.nn.Linear, Int8RowLinear, Q4KRowLinear)))


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    from specdec_tools.testing.tiny_models import build_gguf_model_dir

    return build_gguf_model_dir(tmp_path_factory.mktemp("gguf") / "tiny-gguf", seed=4,
                                mismatch=("model.layers.1.mlp.up_proj",))


def test_the_gguf_index_reads_what_gguf_py_reads(gguf_dir):
    """modeling.gguf_tensors walks only the header: the same tensors, types and bytes as gguf-py's
    GGUFReader (which parses every metadata field), block rows shaped as GGUFReader shapes them."""
    import numpy as np
    from gguf import GGUFReader

    from specdec.modeling import gguf_tensors

    path = next(gguf_dir.glob("*.gguf"))
    ours = gguf_tensors(path)
    theirs = {t.name: t for t in GGUFReader(path).tensors}
    assert set(ours) == set(theirs) and len(ours) > 10
    for name, t in theirs.items():
        kind, rows = ours[name]
        assert kind == t.tensor_type, name
        assert np.array_equal(rows.reshape(-1), np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)), name
        if t.tensor_type.name in ("Q4_K", "Q6_K"):
            assert rows.shape == t.data.shape, name


@needs_native
def test_int4_rows_takes_the_gguf_blocks_that_match_the_store_and_int8_rows_elsewhere(gguf_dir, monkeypatch):
    from specdec.kernels import Q4KRowLinear, Q6KRowLinear
    from specdec_tools.testing.tiny_models import GGUF_Q6K

    loaded = _int4_target(gguf_dir).loaded
    assert loaded.quantization == "int4-rows"
    model = loaded.model
    kinds = {name: type(mod).__name__ for name, mod in model.named_modules()
             if isinstance(mod, (Q4KRowLinear, Q6KRowLinear, Int8RowLinear))}
    assert kinds.pop("lm_head") == "Int8RowLinear"  # not in the GGUF
    assert kinds.pop("model.layers.1.mlp.up_proj") == "Int8RowLinear"  # the GGUF's blocks are not the store's
    assert all(kinds.pop(name) == "Q6KRowLinear" for name in GGUF_Q6K)  # the GGUF's Q6_K tensors
    assert len(kinds) == 11 and set(kinds.values()) == {"Q4KRowLinear"}
    stored = load_model(str(gguf_dir), dtype="float32", quantization="none").model
    g = torch.Generator().manual_seed(5)
    for name in ("model.layers.0.mlp.gate_proj", "model.layers.1.self_attn.k_proj", *GGUF_Q6K):
        x = torch.randn(3, model.get_submodule(name).in_features, generator=g)
        exact = stored.get_submodule(name)(x).detach()  # the store's weights: the blocks' values to float16
        got = model.get_submodule(name)(x).detach()
        assert float((got - exact).norm() / exact.norm()) < 0.05, name
    monkeypatch.setenv("SPECDEC_Q6K", "0")  # the ablation: the Q6_K tensors requantized to int8-rows
    ablated = load_model(str(gguf_dir), quantization="int4-rows").model
    assert all(isinstance(ablated.get_submodule(name), Int8RowLinear) for name in GGUF_Q6K)


@needs_native
def test_int4_rows_without_a_source_gguf_runs_int8_rows_everywhere(model_dirs):
    loaded = load_model(str(model_dirs["target"]), quantization="int4-rows")
    assert loaded.quantization == "int8-rows"  # what it is without blocks, as ModelInfo reports it
    linears = [m for m in loaded.model.modules() if isinstance(m, (torch.nn.Linear, Int8RowLinear))]
    assert linears and all(isinstance(m, Int8RowLinear) for m in linears)


@needs_native
def test_int4_rows_finds_the_gguf_in_a_cache_mounted_elsewhere(tmp_path, caplog):
    """source.json names the GGUF by the path it had when converted; a cache mounted at another
    path (a container's volume) still has it in gguf/ beside converted/."""
    import json

    from specdec_tools.testing.tiny_models import build_gguf_model_dir

    model = build_gguf_model_dir(tmp_path / "converted" / "tiny", seed=6)
    (tmp_path / "gguf").mkdir()
    (model / "model.gguf").rename(tmp_path / "gguf" / "tiny.gguf")
    (model / "source.json").write_text(json.dumps({"source_gguf": "/elsewhere/gguf/tiny.gguf"}))
    assert load_model(str(model), quantization="int4-rows").quantization == "int4-rows"
    (tmp_path / "gguf" / "tiny.gguf").unlink()
    with caplog.at_level("WARNING"):
        assert load_model(str(model), quantization="int4-rows").quantization == "int8-rows"
    assert "is gone" in caplog.text


@needs_native
@pytest.mark.parametrize("k", [2, 5, 9])
def test_an_int4_rows_target_verifies_k_rows_as_k_single_steps(gguf_dir, k):
    """The tiny GGUF target under int4-rows: a k-row verify equals k one-row steps bitwise."""
    engine = _int4_target(gguf_dir)
    prompt, drafts = [5, 9, 14, 20, 31, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48][: k - 1]
    engine.open_session("whole", prompt)
    engine.open_session("steps", prompt)
    try:
        whole = engine.verify("whole", len(prompt), [], drafts, GREEDY, top_logprobs=0)
        steps = [engine.verify("steps", len(prompt) - 1, [prompt[-1]], [], GREEDY, top_logprobs=0)]
        for i, d in enumerate(drafts):
            steps.append(engine.verify("steps", len(prompt) + i, [d], [], GREEDY, top_logprobs=0))
        assert whole.argmax == [s.argmax[0] for s in steps]
        assert whole.logprob_bases == [s.logprob_bases[0] for s in steps]
    finally:
        engine.close_session("whole")
        engine.close_session("steps")


_INT4: dict = {}


def _int4_target(path):
    if path not in _INT4:
        _INT4[path] = TargetEngine(load_model(str(path), quantization="int4-rows"))
    return _INT4[path]


def _huge_pages_of(ptr: int) -> int:
    """kB of transparent huge pages in this process's mapping that holds address `ptr`."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "none"
    return text[text.index("[") + 1:text.index("]")]


@needs_native
def test_the_kernels_weights_sit_on_huge_pages_with_the_same_bits(monkeypatch):
    """A 1-row pass streams every weight once: the native kernels' weights are on 2 MiB pages
    (fewer page walks), 64-byte aligned, and compute the same bits as on ordinary pages."""
    if _thp_mode() not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {_thp_mode()} here")
    torch.manual_seed(1)
    linear = torch.nn.Linear(1024, 4096)
    x = torch.randn(3, 1024)
    on_huge = Int8RowLinear(linear, native=True)
    ptr = on_huge._weight.data_ptr()
    assert ptr % 64 == 0 and _huge_pages_of(ptr) >= 2048
    monkeypatch.setenv("SPECDEC_HUGE_PAGES", "0")
    ordinary = Int8RowLinear(linear, native=True)
    assert ordinary._weight.data_ptr() % 64 == 0 and _huge_pages_of(ordinary._weight.data_ptr()) == 0
    assert torch.equal(on_huge(x), ordinary(x))


@needs_native
def test_loading_leaves_the_kernels_weights_where_they_were_made(gguf_dir, monkeypatch):
    """modeling.own_memory copies what the model shares with its weight files, not the kernels'
    own tensors: they would leave their huge pages (and cost a second copy while loading)."""
    from specdec import kernels
    from specdec.kernels import Q4KRowLinear

    made = []
    take = kernels.weight_memory.take
    monkeypatch.setattr(kernels.weight_memory, "take", lambda n: made.append(take(n)) or made[-1])
    model = load_model(str(gguf_dir), quantization="int4-rows").model
    pointers = {t.data_ptr() for t in made}
    mods = [m for m in model.modules() if isinstance(m, (Q4KRowLinear, Int8RowLinear))]
    buffers = [b for m in mods for b in m.buffers() if b.dtype in (torch.uint8, torch.int8)]
    assert mods and buffers and all(b.data_ptr() in pointers for b in buffers)


@needs_native
def test_a_native_module_follows_its_tensors_when_torch_moves_them():
    """The modules keep their tensors' addresses (a step makes ~200 calls): when torch replaces the
    tensors (Module._apply, behind .to(), .float(), share_memory(): here a copy of each), the
    addresses follow."""
    from specdec.kernels import Q4KRowLinear
    from specdec_tools.testing.tiny_models import random_q4k_blocks

    torch.manual_seed(2)
    x = torch.randn(2, 512)
    for module in (Int8RowLinear(torch.nn.Linear(512, 64), native=True),
                   Q4KRowLinear(512, 64, random_q4k_blocks(64, 512, torch.Generator().manual_seed(3)), torch.randn(64))):
        want = module(x)
        before = module._ptrs
        module._apply(lambda t: t.clone())
        tensors = [t for t in (*module.buffers(), module.bias) if t is not None]
        assert module._ptrs != before and set(module._ptrs) - {None} <= {t.data_ptr() for t in tensors}
        assert torch.equal(module(x), want)


@needs_native
def test_q4k_rows_keeps_its_requantized_blocks_and_reads_them_back(gguf_dir, tmp_path, monkeypatch):
    """For a model of the store (under the cache root) the blocks q4k-rows computes are kept there
    and read back by the next load (no requantization: the same blocks); a store whose files
    changed computes them again; a model directory elsewhere keeps nothing."""
    import shutil

    from specdec import kernels

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    load_model(str(gguf_dir), quantization="q4k-rows")  # not the store's: nothing kept
    assert not (tmp_path / "cache" / "q4k").exists()
    stored = tmp_path / "cache" / "converted" / "tiny"
    shutil.copytree(gguf_dir, stored)
    gguf_dir = stored
    first = load_model(str(gguf_dir), quantization="q4k-rows").model
    kept = list((tmp_path / "cache" / "q4k").glob("*.safetensors"))
    assert len(kept) == 1
    calls = []
    real = kernels.q4k_quantize
    monkeypatch.setattr(kernels, "q4k_quantize", lambda w, *a, **k: calls.append(1) or real(w, *a, **k))
    again = load_model(str(gguf_dir), quantization="q4k-rows").model
    assert not calls
    for name in ("lm_head", "model.layers.1.mlp.up_proj"):  # requantized (no GGUF blocks for them)
        assert torch.equal(again.get_submodule(name)._qs, first.get_submodule(name)._qs)
    shard = next(gguf_dir.glob("*.safetensors"))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # the store changed
    load_model(str(gguf_dir), quantization="q4k-rows")
    assert calls and len(list((tmp_path / "cache" / "q4k").glob("*.safetensors"))) == 2


def test_a_worker_says_which_kernels_its_passes_run_on(int8_rows_target, target_engine):
    """Describe (ModelInfo.kernels, beside dtype's quantization) names the code the passes run
    on, so an operator sees a fallback (fbgemm, torch) rather than only a slower server."""
    info = int8_rows_target.describe()
    assert info.dtype == "float32+int8-rows-weights"
    library = native_library()
    assert info.kernels == (f"native {library.isa}" if library is not None else "fbgemm")
    assert target_engine.describe().kernels == "torch"  # float64, no quantization: the model's own layers
    assert info.to_proto().kernels == info.kernels  # and it travels

"""specdec.worker.forward: the lean pass computes transformers' own forward bit for bit (logits and
the keys and values it caches) on ragged batches, for the model families it takes; others keep
transformers' forward."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM

from specdec.kernels import native_available
from specdec.worker.batching import NO_MASK, RaggedCache
from specdec.worker.forward import lean_forward, lean_forward_fits, model_forward
from tests.support.models import SHAPE, random_model

def _transformers(model, ids, positions, cache, keep):
    return model(input_ids=ids, position_ids=positions, attention_mask=NO_MASK, past_key_values=cache,
                 use_cache=True, logits_to_keep=keep).logits


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@torch.inference_mode()
def test_the_lean_pass_is_transformers_forward_bit_for_bit(kind, dtype):
    """Two sessions: prefills of 7 and 3 tokens in one pass, then decoding work (1 row and a
    5-row verify) in another, then a pass of one session alone: each pass's logits and every
    cached key and value equal what transformers' forward computes."""
    model = random_model(kind, dtype)
    assert lean_forward_fits(model)
    g = torch.Generator().manual_seed(3)
    ours = [DynamicCache(config=model.config) for _ in range(2)]
    theirs = [DynamicCache(config=model.config) for _ in range(2)]
    lengths = [0, 0]
    for new, keep in [((7, 3), [6, 9]), ((1, 5), [0, 1, 2, 3, 4, 5]), ((0, 2), [0, 1])]:
        sessions = [i for i, n in enumerate(new) if n]
        ids = torch.randint(0, SHAPE["vocab_size"], (1, sum(new)), generator=g)
        positions = torch.tensor([[p for i in sessions for p in range(lengths[i], lengths[i] + new[i])]])
        keep_rows = torch.tensor(keep)
        rows = [new[i] for i in sessions]
        got = lean_forward(model, ids, positions, RaggedCache([ours[i] for i in sessions], rows), keep_rows)
        want = _transformers(model, ids, positions, RaggedCache([theirs[i] for i in sessions], rows), keep_rows)
        assert got.dtype == want.dtype and torch.equal(got, want)
        for i in sessions:
            lengths[i] += new[i]
    for mine, its in zip(ours, theirs):
        for a, b in zip(mine.layers, its.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_other_models_keep_transformers_forward(monkeypatch):
    """A family the lean pass does not repeat (Mistral: sliding windows), and any model with
    SPECDEC_LEAN_FORWARD=0, runs its own forward."""
    mistral = MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=16)).eval()
    assert not lean_forward_fits(mistral)
    qwen = random_model("qwen2", torch.float32)
    assert lean_forward_fits(qwen)
    calls = []
    monkeypatch.setattr("specdec.worker.forward.lean_forward", lambda *a: calls.append(a))
    ids, positions, keep = torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), torch.tensor([1])
    model_forward(qwen)(ids, positions, RaggedCache([DynamicCache(config=qwen.config)], [2]), keep)
    assert len(calls) == 1
    monkeypatch.setenv("SPECDEC_LEAN_FORWARD", "0")
    logits = model_forward(qwen)(ids, positions, RaggedCache([DynamicCache(config=qwen.config)], [2]), keep)
    assert len(calls) == 1 and logits.shape == (1, 1, SHAPE["vocab_size"])


def test_a_model_with_a_layer_of_another_kind_or_spread_over_devices_keeps_transformers_forward():
    model = random_model("qwen2", torch.float32)
    odd = copy.deepcopy(model)
    odd.model.layers[1] = torch.nn.Identity()
    assert not lean_forward_fits(odd)
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}  # accelerate's hooks move tensors per layer
    assert not lean_forward_fits(model)


# two sessions' passes: new tokens of each, or a rollback of both ("crop", tokens), or a fork of the first
STEPS = [(40, 3), (1, 5), ("crop", 3), (5, 1), (1, 1), ("fork", 0), ("crop", 1), (2, 5)] + [(1, 5)] * 12


def _two_paths(model, steps, check, ours, theirs):
    """Runs `steps` through two forwards, each on its own two caches: ours/theirs(ids, positions,
    caches, new rows, keep) -> logits, check(step, ours' logits, theirs') after each pass ->
    (our caches, theirs)."""
    g = torch.Generator().manual_seed(5)
    mine = [DynamicCache(config=model.config) for _ in range(2)]
    its = [DynamicCache(config=model.config) for _ in range(2)]
    lengths = [0, 0]
    for step in steps:
        if step[0] == "crop":  # a rollback: both sessions drop their last tokens
            for cache in mine + its:
                cache.crop(-step[1])
            lengths = [n - step[1] for n in lengths]
            continue
        if step[0] == "fork":
            mine[0], its[0] = copy.deepcopy(mine[0]), copy.deepcopy(its[0])
            continue
        ids = torch.randint(0, SHAPE["vocab_size"], (1, sum(step)), generator=g)
        positions = torch.tensor([[p for i in range(2) for p in range(lengths[i], lengths[i] + step[i])]])
        keep = torch.arange(sum(step))
        check(step, ours(ids, positions, mine, list(step), keep), theirs(ids, positions, its, list(step), keep))
        lengths = [n + k for n, k in zip(lengths, step)]
    return mine, its


@torch.inference_mode()
def test_caches_that_grow_in_place_compute_what_concatenation_computes(monkeypatch):
    """grow_append (keys and values written into buffers with room to grow) against transformers'
    DynamicLayer.update (concatenation), through prefills of 40 and 3 tokens, decoding work of 1
    and 5 rows, rollbacks (crop) that the next pass writes over, buffers that fill and move, and a
    copied session (a fork): every pass's logits and the caches' keys and values, bit for bit."""
    from transformers.cache_utils import DynamicLayer

    from specdec.worker import batching

    monkeypatch.setattr(batching, "GROW_MIN", 16)  # buffers fill and move several times
    model = random_model("qwen2", torch.float32)
    forward = model_forward(model)

    def check(step, got, want):
        assert torch.equal(got, want), step

    grown, joined = _two_paths(model, STEPS + [(1, 5)] * 33, check,
                               lambda *a: forward(*a[:2], RaggedCache(a[2], a[3]), a[4]),
                               lambda *a: forward(*a[:2], RaggedCache(a[2], a[3], append=DynamicLayer.update), a[4]))
    assert grown[1].get_seq_length() > 4 * batching.GROW_MIN  # the buffers filled and moved, more than once
    for a_cache, b_cache in zip(grown, joined):
        for a, b in zip(a_cache.layers, b_cache.layers):
            assert a.keys.shape[-2] == b.keys.shape[-2] == a_cache.get_seq_length()
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@torch.inference_mode()
def test_rows_over_long_contexts_verify_as_single_steps():
    """From ONE_ROW_MATMUL_MIN_KEYS keys a decoding row's attention is two matmuls around a
    softmax (not SDPA): a 6-row verify over ~200 cached tokens still equals 6 single steps bit
    for bit (the rows cross the threshold inside the verify), and the attention stays within
    float32 rounding of SDPA's."""
    from specdec.modeling import quantize
    from specdec.worker.batching import ONE_ROW_MATMUL_MIN_KEYS, one_row_attention

    model = quantize(random_model("qwen2", torch.float32), "int8-rows")  # rows independent in the Linears too
    forward = model_forward(model)
    g = torch.Generator().manual_seed(9)
    context = ONE_ROW_MATMUL_MIN_KEYS - 3
    prompt = torch.randint(0, SHAPE["vocab_size"], (1, context), generator=g)
    cache = DynamicCache(config=model.config)
    forward(prompt, torch.arange(context)[None], RaggedCache([cache], [context]), torch.tensor([context - 1]))
    rows = torch.randint(0, SHAPE["vocab_size"], (1, 6), generator=g)
    single = copy.deepcopy(cache)
    verify = forward(rows, torch.arange(context, context + 6)[None], RaggedCache([cache], [6]), torch.arange(6))
    steps = torch.cat([forward(rows[:, i:i + 1], torch.tensor([[context + i]]), RaggedCache([single], [1]),
                               torch.tensor([0])) for i in range(6)], dim=1)
    assert torch.equal(verify, steps)
    q, k, v = torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 2, 300, 16, generator=g), \
        torch.randn(1, 2, 300, 16, generator=g)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True)
    assert torch.allclose(one_row_attention(q, k, v, 0.25), want, atol=1e-6, rtol=1e-5)


# ---- the native forward (specdec/csrc/decoder.c) ----------------------------------------------

native = pytest.mark.skipif(not native_available(), reason="the native kernels do not build here")


def _native_model(kind: str, quantization: str = "int8-rows"):
    from specdec.modeling import quantize

    return quantize(random_model(kind, torch.float32), quantization)  # every projection on a native row kernel


@native
@pytest.mark.parametrize("kind,quantization", [("qwen2", "int8-rows"), ("llama", "int8-rows"),
                                               ("qwen2", "q4k-rows")])
@torch.inference_mode()
def test_the_native_pass_computes_the_lean_one_through_rollbacks_forks_and_moving_buffers(kind, quantization,
                                                                                         monkeypatch):
    """Two sessions through prefills (40 and 3 tokens), decoding work of 1 and 5 rows, rollbacks
    that the next pass writes over, a fork, and cache buffers that fill and move: every pass's
    logits and the cached keys and values within float32 rounding of lean_forward's on the same model
    (each path on its own caches; int8 activations turn a rounding difference into a step of 1/127
    now and then), where a key written to the wrong row or a wrong mask differs by ~the logits."""
    from specdec.worker import batching
    from specdec.worker.forward import NativeForward, native_forward_fits

    monkeypatch.setattr(batching, "GROW_MIN", 16)
    model = _native_model(kind, quantization)  # q4k-rows: Q4_K blocks for 256 columns, 64 of them real
    assert native_forward_fits(model) and isinstance(model_forward(model), NativeForward)
    forward = NativeForward(model)

    def check(step, got, want):
        diff = (got - want).abs()  # measured: mean <= 3.3e-4 and max <= 5e-3 against mean |logit| 0.13
        assert diff.mean() < 2e-3 and diff.max() < 0.03, (step, diff.mean(), diff.max())

    ours, lean = _two_paths(model, STEPS, check, lambda *a: forward(*a[:2], RaggedCache(a[2], a[3]), a[4]),
                            lambda *a: lean_forward(model, *a[:2], RaggedCache(a[2], a[3]), a[4]))
    assert ours[1].get_seq_length() > 4 * batching.GROW_MIN
    for mine, its in zip(ours, lean):
        assert mine.get_seq_length() == its.get_seq_length()
        for a, b in zip(mine.layers, its.layers):
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                assert (x - y).abs().mean() < 2e-3 and (x - y).abs().max() < 0.05


@native
@torch.inference_mode()
def test_native_rows_verify_as_single_steps_whatever_else_the_pass_holds():
    """Over ~300 cached tokens (where the attention of a pass runs on two threads, one row and head
    to a thread, and that of a single step on one): a 6-row verify equals 6 single steps bit for
    bit, and so does the same verify in a pass beside another session's prefill."""
    model = _native_model("qwen2")
    forward = model_forward(model)
    g = torch.Generator().manual_seed(9)
    context = 300
    prompt = torch.randint(0, SHAPE["vocab_size"], (1, context), generator=g)
    cache = DynamicCache(config=model.config)
    forward(prompt, torch.arange(context)[None], RaggedCache([cache], [context]), torch.tensor([context - 1]))
    rows = torch.randint(0, SHAPE["vocab_size"], (1, 6), generator=g)
    single, beside = copy.deepcopy(cache), copy.deepcopy(cache)
    verify = forward(rows, torch.arange(context, context + 6)[None], RaggedCache([cache], [6]), torch.arange(6))
    steps = torch.cat([forward(rows[:, i:i + 1], torch.tensor([[context + i]]), RaggedCache([single], [1]),
                               torch.tensor([0])) for i in range(6)], dim=1)
    assert torch.equal(verify, steps)
    other = torch.randint(0, SHAPE["vocab_size"], (1, 50), generator=g)
    both = forward(torch.cat([other, rows], dim=1), torch.cat([torch.arange(50), torch.arange(context, context + 6)])[None],
                   RaggedCache([DynamicCache(config=model.config), beside], [50, 6]), torch.arange(50, 56))
    assert torch.equal(both, verify)
    for a, b in zip(cache.layers, beside.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@native
@torch.inference_mode()
def test_the_native_pass_follows_its_tensors_when_torch_moves_them():
    """After the model's tensors move (Module._apply: here each one cloned, the old memory freed),
    the native pass reads them where they are now: the same logits as before the move."""
    model = _native_model("llama")
    forward = model_forward(model)
    ids, positions = torch.tensor([[5, 17, 42, 9]]), torch.arange(4)[None]
    before = forward(ids, positions, RaggedCache([DynamicCache(config=model.config)], [4]), torch.arange(4))
    model._apply(lambda t: t.clone())
    after = forward(ids, positions, RaggedCache([DynamicCache(config=model.config)], [4]), torch.arange(4))
    assert torch.equal(before, after)


def test_models_off_the_native_kernels_keep_the_lean_pass(monkeypatch):
    """The native pass only where every projection runs on the native row kernels, the MLP is SiLU
    and the weights float32; SPECDEC_NATIVE_FORWARD=0 keeps the lean pass (the ablation)."""
    from specdec.modeling import quantize
    from specdec.worker.forward import NativeForward, native_forward_fits

    assert not native_forward_fits(random_model("qwen2", torch.float32))  # plain Linears
    assert not native_forward_fits(quantize(random_model("qwen2", torch.float32), "int8"))  # fbgemm's kernels
    if native_available():
        model = _native_model("qwen2")
        assert native_forward_fits(model)
        monkeypatch.setenv("SPECDEC_NATIVE_FORWARD", "0")
        assert not isinstance(model_forward(model), NativeForward)
        monkeypatch.delenv("SPECDEC_NATIVE_FORWARD")
        model.config.hidden_act = "gelu"
        assert not native_forward_fits(model)


# ---- features for a feature head (specdec/eagle3.py) ------------------------------------------

@pytest.mark.parametrize("path", ["plain", "lean", "native"])
@torch.inference_mode()
def test_every_forward_returns_the_residual_stream_entering_the_asked_layers(path, monkeypatch):
    """forward(..., aux=layers) -> (the same logits as without, each row's input to those layers
    side by side): transformers' hidden_states[i] for every row of a two-session pass (a prefill
    beside a 3-row verify), in the order asked (layer 2 before layer 0)."""
    from specdec.worker.forward import NativeForward

    if path == "native" and not native_available():
        pytest.skip("the native kernels do not build here")
    model = _native_model("qwen2") if path == "native" else random_model("qwen2", torch.float64)
    if path == "plain":
        monkeypatch.setenv("SPECDEC_LEAN_FORWARD", "0")
    forward = model_forward(model)
    assert isinstance(forward, NativeForward) == (path == "native")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 12), generator=g)
    caches = [DynamicCache(config=model.config) for _ in range(2)]
    forward(ids[:, :4], torch.arange(4)[None], RaggedCache([caches[1]], [4]), torch.tensor([3]))
    positions = torch.cat([torch.arange(9), torch.arange(4, 7)])[None]
    rows = torch.cat([ids[:, 3:12], ids[:, 7:10]], dim=1)  # session 0's prefill, session 1's verify
    plain = forward(rows, positions, RaggedCache(copy.deepcopy(caches), [9, 3]), torch.tensor([8, 9, 10, 11]))
    logits, features = forward(rows, positions, RaggedCache(caches, [9, 3]), torch.tensor([8, 9, 10, 11]),
                               aux=(2, 0))
    assert torch.equal(logits, plain)
    assert features.shape == (12, 2 * SHAPE["hidden_size"])
    reference = random_model("qwen2", torch.float64)  # the same weights (seeded), unquantized for the native path
    if path == "native":
        reference = model
    first = reference(ids[:, 3:12], output_hidden_states=True).hidden_states
    want_first = torch.cat([first[2][0], first[0][0]], dim=-1)
    tol = 1e-9 if path != "native" else 2e-3
    assert (features[:9].double() - want_first.double()).abs().max() < tol
    second = reference(torch.cat([ids[:, :4], ids[:, 7:10]], dim=1), output_hidden_states=True).hidden_states
    want_second = torch.cat([second[2][0, 4:], second[0][0, 4:]], dim=-1)
    assert (features[9:].double() - want_second.double()).abs().max() < tol

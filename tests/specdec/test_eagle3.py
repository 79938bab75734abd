"""specdec.eagle3: EAGLE-3 heads load from both layouts, are refused where they do not fit the
target, and compute one pass over many tokens as those tokens one at a time."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from specdec.eagle3 import HeadForward, default_feature_layers, is_head_dir, load_head, read_head_config
from specdec.worker.batching import RaggedCache
from specdec_tools.testing.tiny_models import build_head_dir

VOCAB, HIDDEN = 300, 64


def _load(path, **kw):
    args = dict(vocab_size=VOCAB, target_layers=6, target_hidden=HIDDEN, max_context=256, dtype=torch.float64,
                target_embedding=lambda: torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)))
    return load_head(path, **{**args, **kw})


@pytest.mark.parametrize("layout", ["vllm", "speculators"])
def test_both_layouts_load_with_their_layers_vocabulary_and_embedding(tmp_path, layout):
    path = build_head_dir(tmp_path / layout, target_hidden=HIDDEN, target_vocab=VOCAB, seed=1, layout=layout,
                          draft_vocab=50, feature_layers=(1, 3, 4), with_embedding=layout == "vllm")
    assert is_head_dir(path)
    config = read_head_config(path)
    assert config.feature_layers == (1, 3, 4) and config.draft_vocab_size == 50
    assert config.norm_before_residual == (layout == "speculators")
    asked = []
    head = _load(path, target_embedding=lambda: asked.append(1) or torch.zeros(VOCAB, HIDDEN))
    assert head.feature_layers == (1, 3, 4) and head.feature_size == 3 * HIDDEN
    assert asked == ([] if layout == "vllm" else [1])  # the target's embedding only where the head has none
    d2t = json.loads((path / "config.json").read_text())["draft_vocab_size"]
    assert head.draft_ids.numel() == d2t and head.draft_ids.unique().numel() == d2t


def test_a_head_without_layer_ids_reads_vllms_default_layers(tmp_path):
    path = build_head_dir(tmp_path / "h", target_hidden=HIDDEN, target_vocab=VOCAB, seed=1)
    assert _load(path, target_layers=28).feature_layers == default_feature_layers(28) == (2, 14, 25)


@pytest.mark.parametrize("case,match", [
    ("layers", "reads the target's layers"), ("hidden", "hidden size"), ("two_layers", "2 decoder layers"),
    ("d2t", "outside the target's vocabulary"), ("not_a_head", "no EAGLE-3 head")])
def test_a_head_that_does_not_fit_the_target_is_refused(tmp_path, case, match):
    from safetensors.torch import load_file, save_file

    path = build_head_dir(tmp_path / "h", target_hidden=HIDDEN, target_vocab=VOCAB, seed=1, draft_vocab=40,
                          feature_layers=(1, 2, 5))
    kw = {}
    weights = path / "model.safetensors"
    if case == "layers":
        kw["target_layers"] = 5  # layer 5 does not exist
    elif case == "hidden":
        kw["target_hidden"] = 32
    elif case == "two_layers":
        state = load_file(str(weights))
        state["layers.1.mlp.up_proj.weight"] = state["midlayer.mlp.up_proj.weight"].clone()
        save_file(state, str(weights))
    elif case == "d2t":
        state = load_file(str(weights))
        state["d2t"] = state["d2t"] + VOCAB
        save_file(state, str(weights))
    else:
        (path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64}))
    with pytest.raises(ValueError, match=match):
        _load(path, **kw)


@torch.inference_mode()
def test_a_pass_over_many_tokens_is_those_tokens_one_at_a_time_and_token_0_is_seen_by_none(tmp_path):
    """Logits and states of a 7-token pass equal a 3-token pass then four 1-token passes; the head's
    logits are -inf off its draft vocabulary; changing token 0 changes nothing after it (it has
    no feature: as in vLLM, no later position attends to it)."""
    head = _load(build_head_dir(tmp_path / "h", target_hidden=HIDDEN, target_vocab=VOCAB, seed=2, draft_vocab=80,
                                feature_layers=(0, 1, 2)))
    forward = HeadForward(head)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (1, 7), generator=g)
    states = torch.randn(7, HIDDEN, generator=g, dtype=torch.float64)
    positions = torch.arange(7)[None]

    def run(ids):
        cache = DynamicCache(config=head.config)
        whole = forward(ids, positions, RaggedCache([cache], [7]), torch.arange(7), states)
        return whole, cache

    (logits, out), _ = run(ids)
    assert torch.isfinite(logits[0]).sum(-1).tolist() == [80] * 7
    cache = DynamicCache(config=head.config)
    parts = [forward(ids[:, :3], positions[:, :3], RaggedCache([cache], [3]), torch.arange(3), states[:3])]
    parts += [forward(ids[:, i:i + 1], positions[:, i:i + 1], RaggedCache([cache], [1]), torch.tensor([0]),
                      states[i:i + 1]) for i in range(3, 7)]
    stepped = torch.cat([p[0] for p in parts], dim=1)
    finite = torch.isfinite(logits)
    assert torch.allclose(logits[finite], stepped[finite], atol=1e-10)
    assert torch.allclose(out, torch.cat([p[1] for p in parts]), atol=1e-10)
    other = ids.clone()
    other[0, 0] = (ids[0, 0] + 1) % VOCAB
    (changed, _), _ = run(other)
    assert not torch.allclose(changed[0, 0][finite[0, 0]], logits[0, 0][finite[0, 0]])
    assert torch.allclose(changed[0, 1:][finite[0, 1:]], logits[0, 1:][finite[0, 1:]], atol=1e-12)

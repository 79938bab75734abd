"""specdec train-head: the head it trains is the head the draft worker serves (the training-time
test's every step equals a drafting step of the loaded head), and a run on a tiny target learns,
writes a loadable head, resumes from its checkpoint and reports held-out acceptance."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig

from specdec.eagle3 import Eagle3Head, HeadForward, load_head
from specdec.worker.batching import RaggedCache
from specdec_tools import train_head
from specdec_tools.testing.tiny_models import build_model_dir

D, VOCAB, DRAFT_VOCAB, LAYERS = 64, 300, 60, 6


def _random_head(seed: int) -> tuple[train_head.TrainHead, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, D, generator=g, dtype=torch.float64)
    lm_full = torch.randn(VOCAB, D, generator=g, dtype=torch.float64) * 0.3
    d2t_ids = torch.sort(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB]).values
    torch.manual_seed(seed)
    head = train_head.TrainHead(D, 96, 4, 2, 16, 3, 1e-6, 10000.0, embed, lm_full[d2t_ids],
                                torch.rand(D, generator=g, dtype=torch.float64) + 0.5).double()
    with torch.no_grad():  # larger than training's init, so that attention and the MLP matter
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.15)
    return head, embed, lm_full, d2t_ids


def _served(head, embed, lm_full, d2t_ids, tmp_path: Path) -> Eagle3Head:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, max_position_embeddings=256,
                         rope_theta=10000.0)
    a = argparse.Namespace(save="float32")
    train_head.save_head(head, tmp_path / "head", d2t_ids, config, (1, 3, 4), a, {})
    return load_head(tmp_path / "head", vocab_size=VOCAB, target_layers=LAYERS, target_hidden=D,
                     target_embedding=lambda: embed, target_output=lambda ids: lm_full[ids], max_context=256,
                     dtype=torch.float64)


def test_every_training_time_test_step_is_a_drafting_step_of_the_served_head(tmp_path):
    """Slot s, step k of the unroll == the k-th draft of a chain rooted at row s + 1, as the worker
    drafts it: rows 0..s+1 prefilled from the target's features, then the head's own states."""
    head, embed, lm_full, d2t_ids = _random_head(0)
    served = _served(head, embed, lm_full, d2t_ids, tmp_path)
    assert torch.equal(served.draft_ids, d2t_ids)
    g = torch.Generator().manual_seed(1)
    n, steps = 14, 4
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    features = torch.randn(n, 3 * D, generator=g, dtype=torch.float64)
    trained = {k: logits for k, logits, _ in head.unroll(ids, features, steps, 0)}
    forward = HeadForward(served)
    for root in (1, 5, 9):
        cache = DynamicCache(config=served.config)
        hidden = torch.cat([torch.zeros(1, D, dtype=torch.float64), served.fc(features[:root])])  # row r: f[r - 1]
        logits, state = forward(ids[None, : root + 1], torch.arange(root + 1)[None],
                                RaggedCache([cache], [root + 1]), torch.tensor([root]), hidden)
        for k in range(1, steps + 1):
            want = trained[k][root - 1]  # slot root - 1
            assert torch.allclose(logits[0, 0, d2t_ids], want, atol=1e-5), (root, k, (logits[0, 0, d2t_ids] - want).abs().max())
            assert torch.isinf(logits[0, 0]).sum() == VOCAB - DRAFT_VOCAB
            if k < steps:
                pos = root + k
                logits, state = forward(ids[None, pos: pos + 1], torch.tensor([[pos]]), RaggedCache([cache], [1]),
                                        torch.tensor([0]), state)


def test_int8_storage_loads_as_the_rows_times_their_scales(tmp_path):
    head, embed, lm_full, d2t_ids = _random_head(2)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, max_position_embeddings=256)
    train_head.save_head(head, tmp_path / "h8", d2t_ids, config, (1, 3, 4), argparse.Namespace(save="int8"), {})
    served = load_head(tmp_path / "h8", vocab_size=VOCAB, target_layers=LAYERS, target_hidden=D,
                       target_embedding=lambda: embed, target_output=lambda ids: lm_full[ids], max_context=256,
                       dtype=torch.float64)
    w = head.gate_proj.weight.detach()
    assert (served.gate_proj.weight - w).abs().max() <= w.abs().amax(1).max() / 254 + 1e-6
    assert torch.allclose(served.lm_head.weight, lm_full[d2t_ids], atol=1e-6)  # the target's own rows, not stored
    from safetensors.torch import load_file

    assert "lm_head.weight" not in load_file(str(tmp_path / "h8" / "model.safetensors"))


def test_a_head_without_lm_head_needs_the_targets_rows(tmp_path):
    head, embed, lm_full, d2t_ids = _random_head(3)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, max_position_embeddings=256)
    train_head.save_head(head, tmp_path / "h", d2t_ids, config, (1, 3, 4), argparse.Namespace(save="int8"), {})
    with pytest.raises(ValueError, match="no lm_head"):
        load_head(tmp_path / "h", vocab_size=VOCAB, target_layers=LAYERS, target_hidden=D,
                  target_embedding=lambda: embed, max_context=256, dtype=torch.float64)


def test_draft_vocabulary_is_the_completions_most_frequent_tokens():
    records = [{"ids": [5, 5, 5, 7, 7, 9], "prompt_ids": [1, 2, 3]}, {"ids": [7, 11], "prompt_ids": [3]}]
    assert train_head.draft_vocabulary(records, 50, 4).tolist() == [5, 7, 9, 11]  # completions first
    assert train_head.draft_vocabulary(records, 50, 6).tolist() == [1, 3, 5, 7, 9, 11]  # then prompts, lower ids first


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("target") / "t", seed=3, layers=LAYERS)


def _args(target: Path, data: Path, out: Path, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    train_head.add_arguments(p)
    argv = ["--target", str(target), "--data", str(data), "--out", str(out), "--quantize", "none",
            "--intermediate", "64", "--draft-vocab", "120", "--top", "8", "--batch-tokens", "64",
            "--holdout-every", "4", "--ttt-steps", "3", "--lr", "3e-3", "--no-bf16"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return p.parse_args(argv)


def _completions(target: Path, path: Path, sequences: int) -> None:
    """The tiny target's own greedy completions of random prompts (what --generate records)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with gzip.open(path, "wt") as f:
        for i in range(sequences):
            prompt = torch.randint(3, 200, (6,), generator=g)
            out = model.generate(prompt[None], max_new_tokens=24, do_sample=False, min_new_tokens=24)
            f.write(json.dumps({"prompt": i, "kind": "code", "mode": "greedy", "temperature": 0.0, "seed": None,
                                "prompt_ids": prompt.tolist(), "ids": out[0, 6:].tolist(), "finish": "length"}) + "\n")


def test_a_tiny_run_learns_writes_a_servable_head_and_resumes(tiny_target, tmp_path):
    from specdec.modeling import load_model

    data = tmp_path / "c.jsonl.gz"
    _completions(tiny_target, data, 16)
    out = tmp_path / "head"
    assert train_head.cmd_train(_args(tiny_target, data, out, epochs=6, eval_every=10, variants="ttt=1;vocab=60")) == 0
    curve = json.loads((out / "curve.json").read_text())
    # it learned the target's choices (a random tiny target's text is not predictable held out)
    trained = [c["train_top1"][0] for c in curve if c["train_top1"]]
    assert trained[-1] > trained[0] + 0.1
    r = curve[-1]
    assert len(r["tokens_greedy"]) == 6 and 1 <= r["tokens_greedy"][0] <= 2
    assert all(a <= b + 1e-9 for a, b in zip(r["tokens_greedy"], r["tokens_greedy"][1:]))
    report = (out / "report.md").read_text()
    assert "first draft accepted" in report
    assert "| ttt_steps=1 |" in report and "| draft_vocab=60 |" in report  # the ablation, beside the head
    loaded = load_model(str(out), target_model=str(tiny_target), role="draft", quantization="none")
    assert loaded.model.lm_head.out_features == 120
    # a finished run started again resumes at its last step: nothing more to train
    before = (out / "model.safetensors").read_bytes()
    assert train_head.cmd_train(_args(tiny_target, data, out, epochs=6, eval_every=10)) == 0
    assert (out / "model.safetensors").read_bytes() == before


def test_a_completions_file_cut_short_keeps_its_whole_records(tmp_path):
    path = tmp_path / "c.jsonl.gz"
    records = [{"prompt": i, "mode": "greedy", "ids": list(range(i, i + 50)), "prompt_ids": [1]} for i in range(40)]
    train_head.write_completions(path, records[::-1])
    assert train_head.read_completions(path) == records  # by prompt, whatever the order written
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) * 2 // 3])  # a run stopped while writing
    kept = train_head.read_completions(path)
    assert 0 < len(kept) < len(records) and kept == records[: len(kept)]


def test_prompt_rows_add_the_prompts_rows_and_leave_the_completions_loss_as_it_was(tiny_target):
    teacher = train_head.Teacher(str(tiny_target), None, "none")
    record = {"prompt": 0, "mode": "greedy", "prompt_ids": list(range(3, 13)), "ids": list(range(40, 60))}
    start, n = 10, 30
    plain = teacher.run(record, 8)
    wide = teacher.run(record, 8, prompt_rows=True)
    assert (plain.labels_from, wide.labels_from) == (start - 1, 0)
    assert wide.top_ids.shape[0] == n and plain.top_ids.shape[0] == n - start + 1
    assert torch.equal(wide.top_ids[start - 1:], plain.top_ids)  # the same target, the same rows

    c = teacher.config
    torch.manual_seed(0)
    head = train_head.TrainHead(c.hidden_size, 64, c.num_attention_heads, c.num_key_value_heads,
                                c.hidden_size // c.num_attention_heads, 3, 1e-6, 10000.0,
                                torch.randn(c.vocab_size, c.hidden_size), torch.randn(c.vocab_size, c.hidden_size) * 0.1,
                                torch.ones(c.hidden_size))
    t2d = torch.arange(c.vocab_size)
    steps, weights = 3, [1.0, 0.8, 0.64]
    with torch.no_grad():
        loss, rows, _ = train_head.sequence_loss(head, plain, t2d, steps, weights)
        same, same_rows, _ = train_head.sequence_loss(head, wide, t2d, steps, weights)
        more, more_rows, _ = train_head.sequence_loss(head, wide, t2d, steps, weights, prompt_rows=True)
    assert same_rows == rows and torch.allclose(same, loss)  # labels kept further back change nothing alone
    assert more_rows - rows == (start - 2) * steps  # rows 1 .. start - 2, at every unrolled step
    assert more > loss  # the completion's terms as before, plus the prompt's
    assert train_head.loss_rows(wide, True) - train_head.loss_rows(wide, False) == start - 1
    with pytest.raises(ValueError, match="prompt rows"):
        train_head.sequence_loss(head, plain, t2d, steps, weights, prompt_rows=True)
    assert train_head.parse_variants("prompt=1;ttt=1") == [{"prompt_rows": True}, {"ttt_steps": 1}]


def test_a_smaller_training_set_is_a_seeded_sample_in_order():
    items = list(range(100))
    few = train_head.subset(items, 10, seed=0)
    assert len(few) == 10 and few == sorted(few) and few == train_head.subset(items, 10, seed=0)
    assert few != items[:10] and few != train_head.subset(items, 10, seed=1)  # drawn, not the first N
    assert train_head.subset(items, 0, seed=0) is items and train_head.subset(items, 200, seed=0) is items
    assert train_head.parse_variants("sequences=90") == [{"limit": 90}]


def test_the_training_prompts_load_from_their_data_file_and_match_the_committed_completions():
    """head_data/prompts.jsonl, as the package loads it: 480 prompts in balanced blocks, and every
    committed completion names a prompt of its own kind (a reordered file would break them)."""
    from specdec_tools.head_data.prompts import KINDS, PROMPTS

    assert len(PROMPTS) == 480 and all(set(p) == {"kind", "prompt"} and p["prompt"] for p in PROMPTS)
    assert {k: sum(p["kind"] == k for p in PROMPTS) for k in KINDS} == {"code": 240, "edit": 120, "explain": 60,
                                                                        "chat": 60}
    block = sorted(["code"] * 4 + ["edit"] * 2 + ["explain", "chat"])
    assert all(sorted(p["kind"] for p in PROMPTS[i:i + 8]) == block for i in range(0, len(PROMPTS), 8))
    assert len({p["prompt"] for p in PROMPTS}) == len(PROMPTS)
    for path in train_head.DATA_DIR.glob("*.completions.jsonl.gz"):
        with gzip.open(path, "rt") as f:
            records = [json.loads(line) for line in f]
        assert records and all(PROMPTS[r["prompt"]]["kind"] == r["kind"] for r in records), path

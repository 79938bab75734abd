"""specdec.worker.paged: the static pass over KV pages computes what the lean pass computes over
DynamicCaches (float64), through joins, leaves, rollbacks, forks and prefill chunks, padded to its
buckets or not; captured passes bind their buffers once; pages come back."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from specdec.errors import ResourceExhausted
from specdec.worker.batching import RaggedCache
from specdec.worker.forward import lean_forward
from specdec.worker.paged import (PAGE, CudaGraph, EagerGraph, KVPages, StaticForward, buckets_for, pick_bucket,
                                  static_forward_fits)
from tests.support.models import SHAPE, random_model


class RecordingGraph(EagerGraph):
    """EagerGraph that records what it was given: each bucket is captured once, and every replay
    reads the very input buffer the capture bound."""

    log: list = []

    def capture(self, fn):
        out = super().capture(fn)
        RecordingGraph.log.append(("capture", id(self)))
        return out

    def replay(self):
        RecordingGraph.log.append(("replay", id(self)))
        super().replay()


def _static(model, graph, sessions=4, tokens=512):
    pages = KVPages.for_model(model, tokens=tokens, sessions=sessions)
    forward = StaticForward(model, pages, max_sessions=sessions, max_context=SHAPE["max_position_embeddings"],
                            graph=graph)
    forward.capture()
    return pages, forward


# what each pass does: (session -> new tokens), then rollbacks/forks/leaves between passes
SCRIPT = [
    ("pass", {0: 7, 1: 3}),                 # two prefills in one pass (padded to 2 sessions x 8 rows)
    ("pass", {0: 1, 1: 5}),                 # a draft step and a 5-row verify
    ("crop", 1, -3),                        # the verify kept 2 of its 5 rows
    ("pass", {1: 4, 0: 1}),                 # the next round, sessions in the other order
    ("fork", 0, 2),                         # session 2 starts as a copy of 0
    ("pass", {2: 2, 0: 1, 1: 1}),           # three sessions, the fork diverging from its parent
    ("leave", 1),
    ("pass", {3: 40}),                      # a new session's prefill (eager), crossing pages, reusing 1's
    ("pass", {3: 1, 2: 3, 0: 8}),
    ("crop", 0, 5),                         # an absolute rollback far back
    ("pass", {0: 2, 3: 1}),
    ("pass", {0: 1, 4: 30, 2: 2}),          # a prefill joins decoding work: graph for 0 and 2, eager for 4
]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("graph", [None, EagerGraph, pytest.param(CudaGraph, marks=CUDA)],
                         ids=["eager", "buckets", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@torch.inference_mode()
def test_the_static_pass_computes_the_lean_pass(kind, graph, dtype, monkeypatch):
    """float64: the same computation to rounding; float32 also runs the fused norm (one rounding
    where transformers has two) and every other kernel a GPU pass runs. cuda: captured CUDA
    graphs on the GPU (TF32 off), against the lean pass there."""
    model = random_model(kind, dtype)
    device = "cuda" if graph is CudaGraph else "cpu"
    if device == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        model = model.to(device)
    assert static_forward_fits(model)
    pages, forward = _static(model, graph)
    free_at_start = pages.free_pages
    g = torch.Generator().manual_seed(11)
    ours: dict[int, object] = {}
    theirs: dict[int, DynamicCache] = {}
    for step in SCRIPT:
        if step[0] == "crop":
            _, s, n = step
            n = n if n < 0 else n - theirs[s].get_seq_length()  # transformers 5 takes a count to drop
            ours[s].crop(n)
            theirs[s].crop(n)
            assert ours[s].get_seq_length() == theirs[s].get_seq_length()
            continue
        if step[0] == "fork":
            _, s, child = step
            ours[child], theirs[child] = copy.deepcopy(ours[s]), copy.deepcopy(theirs[s])
            continue
        if step[0] == "leave":
            ours.pop(step[1]).free()
            theirs.pop(step[1])
            continue
        new = step[1]
        for s in new:
            if s not in ours:
                ours[s], theirs[s] = pages.new_cache(), DynamicCache(config=model.config)
        order = list(new)
        ids = torch.randint(0, SHAPE["vocab_size"], (1, sum(new.values())), generator=g)
        positions = torch.tensor([[p for s in order for p in range(theirs[s].get_seq_length(),
                                                                   theirs[s].get_seq_length() + new[s])]])
        keep = torch.tensor([i for i in range(ids.shape[1]) if i % 2 == 0 or i == ids.shape[1] - 1])
        rows = [new[s] for s in order]
        got = forward(ids, positions, RaggedCache([ours[s] for s in order], rows), keep).cpu()
        want = lean_forward(model, ids.to(device), positions.to(device), RaggedCache([theirs[s] for s in order], rows),
                            keep.to(device)).cpu()
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10 if dtype == torch.float64 else 1e-5)
        for s in order:
            assert ours[s].get_seq_length() == theirs[s].get_seq_length()
    if graph is not None:
        assert forward.replays == 7 and forward.eager_passes == 2  # the prefills of 40 and 30 rows: no bucket
    else:
        assert forward.replays == 0
    for c in ours.values():
        c.free()
    assert pages.free_pages == free_at_start


@torch.inference_mode()
def test_captured_passes_bind_their_buffers_once():
    """Every bucket is captured at start-up; later passes only replay, each reading the input
    buffer its capture bound (no new capture, no pass outside a bucket for decoding work)."""
    RecordingGraph.log = []
    model = random_model("qwen2", torch.float64)
    pages, forward = _static(model, RecordingGraph)
    captures = [g for what, g in RecordingGraph.log if what == "capture"]
    assert len(captures) == len(set(captures)) == len(forward.buckets)
    bound = {b: c.inputs.data_ptr() for b, c in forward._captured.items()}
    caches = [pages.new_cache() for _ in range(3)]
    prefill = torch.arange(30).view(1, 30)
    forward(prefill, torch.arange(30).view(1, 30), RaggedCache(caches[:1], [30]), torch.tensor([29]))
    for c in caches[1:]:
        forward(prefill[:, :5], torch.arange(5).view(1, 5), RaggedCache([c], [5]), torch.tensor([4]))
    RecordingGraph.log = []
    for step in range(6):
        rows = [1, 1 + step % 4, 5][: 1 + step % 3]
        ids = torch.ones(1, sum(rows), dtype=torch.long)
        positions = torch.tensor([[p for c, n in zip(caches, rows) for p in range(c.length, c.length + n)]])
        forward(ids, positions, RaggedCache(caches[:len(rows)], rows), torch.tensor([sum(rows) - 1]))
    assert [what for what, _ in RecordingGraph.log] == ["replay"] * 6
    assert {b: c.inputs.data_ptr() for b, c in forward._captured.items()} == bound


def test_buckets_cover_decoding_work_and_grow_largest_first():
    buckets = buckets_for(max_sessions=16, max_context=32768)
    sizes = [b.sessions * b.keys for b in buckets]
    assert sizes == sorted(sizes, reverse=True)
    assert pick_bucket(buckets, 3, 5, 300) == next(b for b in buckets if (b.sessions, b.rows, b.keys) == (4, 8, 512))
    assert pick_bucket(buckets, 1, 9, 100) is None  # a prefill chunk: eager
    assert pick_bucket(buckets, 17, 1, 100) is None  # more sessions than captured: eager
    assert all(b.sessions <= 16 for b in buckets)


def test_pages_are_bounded_and_freed_after_the_running_pass():
    pages = KVPages(1, 1, 2, tokens=4 * PAGE, sessions=1, dtype=torch.float32, device="cpu")
    assert pages.pages == 4 + 1 + 1
    a, b = pages.new_cache(), pages.new_cache()
    a.reserve(3 * PAGE)
    with pytest.raises(ResourceExhausted, match="max-cached-tokens"):
        b.reserve(3 * PAGE)
    pages.begin_pass()
    a.free()  # a pass still reads its pages: they come back when it ends
    assert pages.free_pages == 5 and len(pages._free) == 2
    pages.end_pass()
    assert len(pages._free) == 5
    b.reserve(5 * PAGE)
    b.length = 5 * PAGE  # as a pass that wrote them leaves it
    b.crop(PAGE + 1)
    assert len(b.pages) == 2 and b.length == PAGE + 1 and len(pages._free) == 3
    b.crop(-PAGE - 1)
    assert b.pages == [] and b.length == 0


# ---- the engines on pages: what a request sees is what it saw on DynamicCaches -------------

@pytest.fixture(scope="module")
def paged_decoder(model_dirs):
    from draft_service.engine import DraftEngine
    from orchestrator.decoder import SpeculativeDecoder
    from specdec.modeling import load_model
    from target_service.engine import TargetEngine

    options = dict(kv_pages=True, graph_class=EagerGraph, max_sessions=16, max_cached_tokens=4096)
    target = TargetEngine(load_model(str(model_dirs["target"]), dtype="float64"), **options)
    draft = DraftEngine(load_model(str(model_dirs["draft"]), dtype="float64"), **options)
    yield SpeculativeDecoder(target, draft, target.tokenizer), target, draft
    target.close()
    draft.close()


@pytest.mark.parametrize("gamma", [0, 3, 6])
def test_greedy_on_pages_matches_generate(paged_decoder, gamma):
    from specdec.protocol import GenerationRequest
    from tests.support.reference import PROMPTS, greedy as reference

    decoder, target, draft = paged_decoder
    for prompt in PROMPTS:
        ids = target.tokenizer(prompt).input_ids
        result = decoder.generate(GenerationRequest(token_ids=ids, max_new_tokens=24, temperature=0, gamma=gamma))
        assert result.token_ids == reference(target, ids, 24)
    assert target.runner.forward.replays > 0 and (draft.runner.forward.replays > 0 or gamma == 0)


def test_a_target_on_pages_feeds_a_feature_head_exactly(paged_decoder, model_dirs, tmp_path):
    """A target whose passes run over KV pages returns features (its feature sessions' passes run
    eagerly), equal to its hidden states, and a feature head drafting from them keeps greedy
    output the target's own."""
    from draft_service.engine import DraftEngine
    from orchestrator.decoder import SpeculativeDecoder
    from specdec.modeling import load_model
    from specdec.protocol import GenerationRequest
    from specdec_tools.testing.tiny_models import build_head_dir
    from tests.support.reference import PROMPTS, greedy as reference

    _, target, _ = paged_decoder
    config = target.model.config
    head_dir = build_head_dir(tmp_path / "head", target_hidden=config.hidden_size, target_vocab=config.vocab_size,
                              seed=4, feature_layers=(1, 0, 1))
    head = DraftEngine(load_model(str(head_dir), dtype="float64", role="draft", target_model=str(model_dirs["target"])))
    try:
        ids = target.tokenizer(PROMPTS[0]).input_ids
        target.open_session("fed", ids, feature_layers=(1, 0))
        opened = target.opened_features("fed")
        target.close_session("fed")
        with torch.inference_mode():
            hidden = target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        torch.testing.assert_close(opened.rows, torch.cat([hidden[1][0], hidden[0][0]], -1)[:-1])
        decoder = SpeculativeDecoder(target, head, target.tokenizer)
        for prompt in PROMPTS[:2]:
            ids = target.tokenizer(prompt).input_ids
            r = decoder.generate(GenerationRequest(token_ids=ids, max_new_tokens=16, temperature=0, gamma=3))
            assert r.token_ids == reference(target, ids, 16)
    finally:
        head.close()


def test_sampled_choices_on_pages_match_dynamic_caches(paged_decoder, target_engine, draft_engine):
    """Seeded sampling with n = 3 choices (forks of one prefill), several requests at once: each
    choice is the one the DynamicCache engines give for its seed; every page comes back."""
    from concurrent.futures import ThreadPoolExecutor

    from orchestrator.decoder import SpeculativeDecoder
    from specdec.protocol import GenerationRequest
    from tests.support.reference import PROMPTS

    decoder, target, draft = paged_decoder
    plain = SpeculativeDecoder(target_engine, draft_engine, target_engine.tokenizer)
    free = target.runner._pages.free_pages, draft.runner._pages.free_pages

    def request(i):
        ids = target.tokenizer(PROMPTS[i]).input_ids
        return GenerationRequest(token_ids=ids, max_new_tokens=20, temperature=0.9, seed=100 + i, gamma=4, n=3)

    with ThreadPoolExecutor(3) as pool:
        ours = list(pool.map(lambda i: decoder.generate(request(i)), range(3)))
    for i, result in enumerate(ours):
        want = plain.generate(request(i))
        assert [c.token_ids for c in result.choices] == [c.token_ids for c in want.choices]
    assert (target.runner._pages.free_pages, draft.runner._pages.free_pages) == free


CHAINED = {  # each session's sampling in a chain: greedy, coupled, or both kinds in one chain
    "greedy": [dict(temperature=0.0)] * 3,
    "coupled": [dict(temperature=0.8, coupling_seed=7), dict(temperature=1.2, top_k=30, coupling_seed=2**64 - 1),
                dict(temperature=1.0, top_p=0.9, min_p=0.02, coupling_seed=1)],
    "mixed": [dict(temperature=1.0, coupling_seed=3), dict(temperature=0.0), dict(temperature=0.6, coupling_seed=4)],
}


@pytest.mark.parametrize("kind", list(CHAINED))
@pytest.mark.parametrize("p_min", [0.0, 0.3])
def test_drafts_chain_on_the_device(paged_decoder, draft_engine, p_min, kind):
    """A batch of greedy or coupled Proposes on pages runs one pass and then its steps back to
    back on the device (StaticForward.chain), gammas of their own, each choice made there: the
    proposals, and where p_min stops a call, where it stops, are those the DynamicCache draft makes
    a pass at a time on the host; the steps past a stop wait as drafts made ahead, taken by the
    next call that agrees."""
    _check_chain(paged_decoder[2], draft_engine, kind, p_min)


@CUDA
@pytest.mark.parametrize("kind", list(CHAINED))
def test_on_cuda_chained_drafts_are_the_drafts_of_eager_passes(model_dirs, kind, monkeypatch):
    """The same on a GPU (float32, TF32 off): Proposes chained over captured CUDA graphs propose
    what the same draft proposes with every pass eager (--cuda-graphs off)."""
    from draft_service.engine import DraftEngine
    from specdec.modeling import load_model

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    options = dict(max_sessions=16, max_cached_tokens=4096)
    graphs = DraftEngine(load_model(str(model_dirs["draft"]), device="cuda", dtype="float32"), **options)
    eager = DraftEngine(load_model(str(model_dirs["draft"]), device="cuda", dtype="float32"), kv_pages=True,
                        cuda_graphs=False, **options)
    try:
        assert graphs.chains and not eager.chains
        _check_chain(graphs, eager, kind, 0.3)
    finally:
        graphs.close()
        eager.close()


def _check_chain(draft, reference, kind: str, p_min: float) -> None:
    """Three sessions' Proposes of gammas 5, 2 and 7 in one batch on `draft` (whose passes chain)
    propose what `reference` proposes; the next call takes what the chain drafted past a stop."""
    from specdec.protocol import SamplingParams
    from specdec.wire import DraftOptions, ProposeCall
    from tests.support.reference import PROMPTS

    options = DraftOptions(p_min=p_min)
    sampling = [SamplingParams(**p) for p in CHAINED[kind]]
    prompts = [draft.tokenizer(p).input_ids for p in PROMPTS[:3]]
    name = f"chain-{kind}-{p_min}"
    for engine in (draft, reference):
        for i, ids in enumerate(prompts):
            engine.open_session(f"{name}-{i}", ids)
    gammas = [5, 2, 7]

    def calls():
        return [ProposeCall(f"{name}-{i}", len(ids), [], g, params, seed=0, options=options)
                for i, (ids, g, params) in enumerate(zip(prompts, gammas, sampling))]

    passes, chained = draft.runner.batcher.passes, draft.runner.forward.chained_steps
    ours = draft.propose_batch(calls())
    assert draft.runner.batcher.passes - passes == 1  # the draft steps did not come back through the batcher
    assert draft.runner.forward.chained_steps - chained == max(gammas) - 1
    theirs = reference.propose_batch(calls())
    for o, t in zip(ours, theirs):
        assert [p.token_id for p in o] == [p.token_id for p in t]
    if p_min:
        assert any(len(o) < g for o, g in zip(ours, gammas))  # p_min stopped some call early
    for i, ids in enumerate(prompts):  # the next round: a call that agrees takes what was drafted on
        made = [p.token_id for p in ours[i]]
        again = draft.propose(f"{name}-{i}", len(ids), [], gammas[i], sampling[i], 0, options)
        assert [p.token_id for p in again] == made
        for engine in (draft, reference):
            engine.close_session(f"{name}-{i}")

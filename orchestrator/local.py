"""The in-process path: both engines in this process, no network, same loop.

    from orchestrator.local import load_local
    decoder = load_local("path/to/target", "path/to/draft")
    print(decoder.generate(GenerationRequest(prompt="def fib(n):", temperature=0)).text)
"""

from __future__ import annotations

from draft_service.engine import DraftEngine
from orchestrator.decoder import SpeculativeDecoder
from specdec.modeling import load_model
from specdec.worker.runner import new_model_thread
from target_service.engine import TargetEngine


def load_local(
    target: str,
    draft: str | None = None,
    *,
    device: str = "cpu",
    dtype: str = "auto",
    device_map: str | None = None,
    draft_device: str | None = None,
    quantization: str = "auto",
    draft_vocab: int = 0,
) -> SpeculativeDecoder:
    # one OpenMP team for both models: they never run at once. The models load on that thread too:
    # a second team, left on the caller's thread, shares the cores and slows every pass on the model thread
    model_thread = new_model_thread()
    target_engine = TargetEngine(
        model_thread.submit(load_model, target, device=device, dtype=dtype, device_map=device_map,
                            quantization=quantization).result(),
        model_thread=model_thread,
    )
    draft_engine = None
    if draft is not None:
        loaded = model_thread.submit(load_model, draft, device=draft_device or device, dtype=dtype,
                                     quantization=quantization, head_rows=draft_vocab, role="draft").result()
        draft_engine = DraftEngine(loaded, model_thread=model_thread)
    return SpeculativeDecoder(target_engine, draft_engine, tokenizer=target_engine.tokenizer)

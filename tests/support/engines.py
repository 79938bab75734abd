"""Looking into worker engines: a model's logits computed afresh (what a session's cached pass must
equal), and a count of the engine's forward passes."""

from __future__ import annotations

import torch


def fresh_logits(engine, tokens, keep):
    with torch.inference_mode():
        return engine.model(torch.tensor([tokens]), logits_to_keep=keep).logits[0]


def count_passes(engine, monkeypatch) -> list[int]:
    """Counts the engine's forward passes (each appends its rows)."""
    rows, original = [], engine.runner._pass

    def counted(batch):
        rows.append(sum(n for _, n in batch.items))
        return original(batch)

    monkeypatch.setattr(engine.runner, "_pass", counted)
    return rows

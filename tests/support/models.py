"""Small random models of the families the lean and static passes take (tests/specdec/worker/
test_forward.py, test_paged.py): transformers' own classes at SHAPE, seeded, ragged attention on."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdec.worker.batching import use_ragged_attention

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def random_model(kind: str, dtype: torch.dtype):
    torch.manual_seed(7)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True))
    else:
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, attention_bias=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
    model = model.to(dtype).eval()
    use_ragged_attention(model)
    return model

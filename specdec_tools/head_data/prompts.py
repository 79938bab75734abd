"""Training prompts for the default pair's EAGLE-3 feature head (`specdec train-head`).

The target (Qwen2.5-Coder-1.5B-Instruct) completes each prompt itself, as a chat-templated user
message, and the head learns the target's habits from those completions (self-distillation). The
set is kept distinct from every benchmark prompt set (specdec_tools/bench_prompts.json,
bench_tracing.py): 480 prompts, 240 "code" (write from scratch, ~40% Python), 120 "edit" (a code
change asked about a snippet), 60 "explain", 60 "chat".

The prompts are data: prompts.jsonl beside this file, one {"kind", "prompt"} a line, in blocks of
8 (4 code, 2 edit, 1 explain, 1 chat), the pattern rotated one step per block, so every prefix of
whole blocks is balanced and the held-out prompts (every 20th) cover all kinds. A completion
names its prompt by its index here (head_data/*.completions.jsonl.gz): append, never reorder.
"""

from __future__ import annotations

import json
from pathlib import Path

KINDS = ("code", "edit", "explain", "chat")
PROMPTS: list[dict] = [json.loads(line) for line in
                       (Path(__file__).with_name("prompts.jsonl")).read_text(encoding="utf-8").split("\n") if line]

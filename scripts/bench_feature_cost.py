"""What returning features costs the target's pass: two sessions of 200 tokens on the default
target, one opened with a head's feature_layers (2, 14, 25), a 5-row verify each, alternating
(docs/benchmarks/feature-heads). Run: .venv/bin/python scripts/bench_feature_cost.py"""

import time, statistics, torch
from specdec.modeling import load_model
from target_service.engine import TargetEngine
from specdec.protocol import SamplingParams
te = TargetEngine(load_model("qwen2.5-coder-1.5b-instruct"))
prompt = [int(t) for t in torch.randint(100, 5000, (200,), generator=torch.Generator().manual_seed(1))]
te.open_session("plain", prompt); te.open_session("fed", prompt, feature_layers=(2, 14, 25))
te.opened_features("fed")
g = SamplingParams(temperature=0)
res = {"plain": [], "fed": []}
for r in range(6):
    for s in (["plain", "fed"] if r % 2 == 0 else ["fed", "plain"]):
        ts = []
        for i in range(8):
            v = te.verify(s, 199, [7 + i % 2], [11, 12, 13, 14], g)
            ts.append(v.pass_s)
        res[s].append(statistics.median(ts))
for s, v in res.items():
    print(s, "5-row verify pass ms: median %.2f (rounds %s)" % (statistics.median(v) * 1e3, [round(x * 1e3, 1) for x in v]))
te.close()

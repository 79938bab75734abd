"""orchestrator.client stays light: a gRPC client of the service needs none of the ML stack."""

from __future__ import annotations

import json
import subprocess
import sys


def test_importing_the_client_loads_neither_torch_nor_transformers():
    code = ("import json, sys; import orchestrator.client; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'numpy'})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []


def test_the_check_above_can_fail():
    """The same probe sees torch when a module that needs it is imported (the check has teeth)."""
    code = "import json, sys; import specdec.sampling; print(json.dumps('torch' in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) is True


def test_async_client_matches_the_blocking_one(client, stack):
    import asyncio

    from orchestrator.client import AsyncClient
    from specdec.errors import ServiceError

    ref = client.generate(prompt="def add(a, b):", max_new_tokens=8, temperature=0)

    async def main():
        async with AsyncClient(stack["address"], timeout_s=60) as ac:
            await ac.wait_until_ready(30)
            whole = await ac.generate(prompt="def add(a, b):", max_new_tokens=8, temperature=0)
            chunks = [c async for c in ac.stream(prompt="def add(a, b):", max_new_tokens=8, temperature=0)]
            both = await asyncio.gather(*[ac.generate(prompt="def add(a, b):", max_new_tokens=8, temperature=0)
                                          for _ in range(2)])
            try:
                await ac.generate(prompt="", max_new_tokens=2)
            except ServiceError as err:
                refused = err.code.name
            workers = await ac.workers()
        return whole, chunks, both, refused, workers

    whole, chunks, both, refused, workers = asyncio.run(main())
    assert whole.token_ids == ref.token_ids and whole.text == ref.text
    assert "".join(c.text_delta for c in chunks) == ref.text and chunks[-1].stats is not None
    assert [b.token_ids for b in both] == [ref.token_ids] * 2
    assert refused == "INVALID_ARGUMENT"
    assert {w["role"] for w in workers} == {"target", "draft"}

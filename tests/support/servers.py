"""Real gRPC servers of each role on free ports, in this process: one worker, or the whole stack."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from draft_service.role import DRAFT
from orchestrator.client import Client
from orchestrator.config import OrchestratorConfig
from orchestrator.server import create_server as create_orchestrator_server
from specdec.worker.config import WorkerConfig
from specdec.worker.server import create_server
from target_service.role import TARGET

HOST = "127.0.0.1"
ADMIN_TOKEN = "admin-token-of-the-tests"  # every test orchestrator takes it (--admin-token-file)


def admin_token_file() -> str:
    import tempfile

    path = Path(tempfile.gettempdir()) / f"specdec-test-admin-{os.getpid()}"
    if not path.exists():
        path.write_text(ADMIN_TOKEN + "\n")
    return str(path)


def create_target(config, engine=None, telemetry=None):
    """A target worker server: (parts, port)."""
    return create_server(TARGET, config, engine, telemetry)


def create_draft(config, engine=None, telemetry=None):
    """A draft worker server: (parts, port)."""
    return create_server(DRAFT, config, engine, telemetry)


def start_unloadable(role: str, target_dir, head_dir) -> tuple:
    """A real worker of `role` whose model fails to load, as one given a feature head made for
    another target does: an EAGLE-3 head (built in head_dir) for a target of hidden size 48, with
    the tiny target (64) as the target it drafts for. (parts, address), once its load has failed."""
    import json

    from specdec_tools.testing.tiny_models import build_head_dir

    config = json.loads((Path(target_dir) / "config.json").read_text())
    assert config["hidden_size"] == 64, "the head is made to be wrong for this target"
    head = build_head_dir(Path(head_dir), target_hidden=48, target_vocab=config["vocab_size"], seed=5,
                          feature_layers=(0, 1, 1))  # layers the tiny target has: only the width is wrong
    parts, port = (create_target if role == "target" else create_draft)(
        WorkerConfig(role, str(head), host=HOST, dtype="float64", target_model=str(target_dir)))
    parts.loader.join(120)
    assert parts.slot.error is not None, "the worker loaded a head made for another target"
    return parts, f"{HOST}:{port}"


def start_orchestrator(targets: list[str], drafts: list[str] = (), *, telemetry=None, **config):
    """An orchestrator server paired with these worker addresses and SERVING: (parts, address).
    Rounds draft the request's gamma (the fixed policy) unless gamma_policy says otherwise: on the
    tiny models a draft costs as much as the target, so the goodput policy would draft nothing."""
    config.setdefault("admin_token_file", admin_token_file())
    config = OrchestratorConfig(target=",".join(targets), draft=",".join(drafts) or None,
                                host=config.pop("host", HOST), gamma_policy=config.pop("gamma_policy", "fixed"),
                                **config)
    parts, port = create_orchestrator_server(config, telemetry=telemetry)
    parts.loader.join(120)
    assert parts.slot.decoder is not None, "the orchestrator did not pair with its workers"
    return parts, f"{config.host}:{port}"


def start_stack(target_engine, draft_engine, *, worker_tls: dict | None = None, telemetry: dict | None = None,
                worker_host: str = HOST, **orchestrator_config) -> dict:
    """Target, draft and orchestrator as real servers on free ports, wired together.
    worker_tls: the servers' TLS settings (WorkerConfig fields) for both workers; telemetry: one
    Telemetry per role name ("target", "draft", "orchestrator"). Stop with stop_stack."""
    telemetry = telemetry or {}
    tls = worker_tls or {}
    target, tport = create_target(WorkerConfig("target", "tiny", host=HOST, **tls), target_engine,
                                  telemetry.get("target"))
    draft, dport = create_draft(WorkerConfig("draft", "tiny", host=HOST, **tls), draft_engine, telemetry.get("draft"))
    orch, address = start_orchestrator([f"{worker_host}:{tport}"], [f"{worker_host}:{dport}"],
                                       telemetry=telemetry.get("orchestrator"), **orchestrator_config)
    return {"target": target, "draft": draft, "orchestrator": orch, "ports": (tport, dport, orch.port),
            "address": address}


def stop_stack(stack: dict) -> None:
    for name in ("orchestrator", "draft", "target"):
        stack[name].stop(None)


def client_of(address: str, **kwargs) -> Client:
    return Client(address, timeout_s=kwargs.pop("timeout_s", 120), **kwargs)


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Polls predicate until it holds; fails after timeout_s (a generous limit, not a timing claim)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not met within {timeout_s} s"
        time.sleep(0.05)


def paced(generate_stream, between):
    """A decoder's generate_stream with `between(i)` called after chunk i is taken (a pause, or
    a gate the test opens), so a test can act while a request is surely in flight."""
    def wrapped(request):
        stream = generate_stream(request)
        try:
            for i, chunk in enumerate(stream):
                yield chunk
                between(i)
        finally:
            stream.close()

    return wrapped


class Streamed(threading.Thread):
    """A greedy request streamed on a thread: its tokens, final stats, error, and the longest
    gap between two of its chunks (the stall a fault caused)."""

    def __init__(self, client, ids, max_new_tokens, **kwargs):
        super().__init__(daemon=True)
        self.chunks = client.stream(token_ids=ids, max_new_tokens=max_new_tokens, temperature=0, gamma=3, **kwargs)
        self.tokens: list[int] = []
        self.stats: dict = {}
        self.error: BaseException | None = None
        self.gaps: list[float] = []
        self.first = threading.Event()

    def run(self):
        try:
            last = time.monotonic()
            for chunk in self.chunks:
                now = time.monotonic()
                if self.tokens:
                    self.gaps.append(now - last)
                last = now
                self.tokens.extend(chunk.token_ids)
                self.stats = chunk.stats or self.stats
                self.first.set()
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.error = exc
        finally:
            self.first.set()

    def result(self, timeout_s=240):
        self.join(timeout_s)
        assert not self.is_alive(), "the request never ended"
        if self.error is not None:
            raise self.error
        return self.tokens, self.stats, max(self.gaps, default=0.0)

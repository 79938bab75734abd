"""Pools of draft and target workers: discovery, health, least-loaded placement, pinning.

A pool is built from address entries, HOST:PORT each; a host name may resolve to many addresses
(every replica of a scaled compose service, every pod behind a Kubernetes headless Service).
A monitor thread re-resolves names every `resolve_s` and polls each member's Describe every
`poll_s`; Describe reports the sessions a worker holds for every orchestrator, so replicas of the
orchestrator see each other's load. A new member must pass `accept` (same vocabulary as the
target) before it gets sessions. A member whose model failed to load (its Describe answers
FAILED_PRECONDITION) is `failed`, with the worker's reason, not one still starting: start-up
stops waiting for a pool whose every member failed (wait_for_member raises LoadFailed).

Placement: a new session goes to the serving member with the fewest sessions (ours, counted
exactly, plus others', as of the last poll), ties to the one we used least. The session stays
pinned to that member for its whole life, because its KV cache lives there.
Adding a worker: start it where a name already resolves to, or call add() (the orchestrator's
AddWorkers RPC); nothing else restarts.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import grpc

from orchestrator.workers import check_pair
from specdec.errors import FailedPrecondition, ServiceError, Unavailable
from specdec.wire import ModelInfo

log = logging.getLogger(__name__)

# member states
JOINING, SERVING, UNAVAILABLE, REFUSED, GONE, DRAINING = "joining", "serving", "unavailable", "refused", "gone", "draining"
FAILED = "failed"  # it answers, but could not load its model (message: the worker's reason); it may be restarted
JOINING_POLL_S = 1.0  # a member that has not answered yet is asked again at least this often, whatever poll_s


class LoadFailed(FailedPrecondition):
    """Every member of a pool answered that its model failed to load: waiting longer is no use."""


def parse_entries(spec: str | Iterable[str] | None) -> list[str]:
    """'a:1, b:2' or ['a:1', 'b:2'] -> ['a:1', 'b:2'] (each checked to be HOST:PORT)."""
    if spec is None:
        return []
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    entries = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"worker address {item!r} is not HOST:PORT")
        entries.append(item)
    return entries


def resolve_addresses(entry: str) -> list[str]:
    """HOST:PORT -> every address the host resolves to (IPv4 first), or [entry] if it is literal
    or does not resolve now (gRPC will keep trying, and so will the next resolution)."""
    host, _, port = entry.rpartition(":")
    bare = host.strip("[]")
    try:
        ipaddress.ip_address(bare)
        return [entry]
    except ValueError:
        pass
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            infos = socket.getaddrinfo(bare, int(port), family, socket.SOCK_STREAM)
        except OSError:
            continue
        ips = sorted({info[4][0] for info in infos})
        if ips:
            return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]
    log.warning("%s does not resolve now; keeping it as given", entry)
    return [entry]


@dataclass
class Member:
    address: str
    entry: str  # the configured entry it came from (a name for DNS members)
    worker: object  # RemoteDraft / RemoteTarget, or an engine in-process
    state: str = JOINING
    message: str = ""
    info: ModelInfo | None = None
    active: int = 0  # sessions of this orchestrator there now (exact)
    others: int = 0  # sessions of other orchestrators there, as of the last poll
    placed: int = 0  # sessions this orchestrator has placed there in total
    missed: int = 0  # polls in a row it did not answer

    @property
    def load(self) -> int:
        return self.active + self.others


class WorkerPool:
    """The workers of one role. Thread-safe; acquire()/release() bracket one session."""

    def __init__(
        self,
        role: str,
        entries: Iterable[str] = (),
        *,
        connect: Callable[[str], object] | None = None,
        resolve: Callable[[str], list[str]] = resolve_addresses,
        poll_s: float = 1.0,
        resolve_s: float = 10.0,
    ):
        self.role = role
        self._entries = list(dict.fromkeys(entries))
        self._connect = connect
        self._resolve = resolve
        self.poll_s, self.resolve_s = poll_s, resolve_s
        self._members: dict[str, Member] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.accept: Callable[[ModelInfo], None] | None = None  # raises FailedPrecondition to refuse; see pair_pools
        self.reference: ModelInfo | None = None  # the model every member must serve (targets)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def fixed(cls, role: str, workers: Iterable[object]) -> "WorkerPool":
        """A pool of given workers (in-process engines, or clients built by the caller)."""
        pool = cls(role)
        for i, worker in enumerate(workers):
            name = getattr(worker, "address", f"in-process-{role}-{i}")
            pool._members[name] = Member(name, name, worker)
        return pool

    # ---- membership ----------------------------------------------------------------------

    def add(self, entries: Iterable[str]) -> None:
        """Adds address entries (resolved now and at every re-resolution)."""
        if self._connect is None:
            raise FailedPrecondition(f"the {self.role} pool holds in-process workers; it cannot add addresses")
        new = [e for e in parse_entries(entries) if e not in self._entries]
        self._entries.extend(new)
        self._resolve_entries(new)
        self.poll()

    def _resolve_entries(self, entries: Iterable[str]) -> set[str]:
        """Adds a member for every new address the entries resolve to; returns all of them."""
        resolved = set()
        for entry in entries:
            addresses = self._resolve(entry)
            resolved.update(addresses)
            for address in addresses:
                with self._lock:
                    if address in self._members and self._members[address].state != GONE:
                        continue
                    if address in self._members:  # came back under the same address
                        self._members[address].state = JOINING
                        continue
                    # an address a name resolved to: TLS must check the certificate for the name
                    name = entry.rpartition(":")[0].strip("[]") if address != entry else None
                    worker = self._connect(address, server_name=name) if name else self._connect(address)
                    self._members[address] = Member(address, entry, worker)
                log.info("%s pool: new member %s (from %s)", self.role, address, entry)
        return resolved

    def _forget_vanished(self, current: set[str]) -> None:
        """Members whose name no longer resolves to them get no new sessions; they leave when idle."""
        with self._lock:
            for address, m in list(self._members.items()):
                if m.entry in self._entries and address not in current:
                    m.state, m.message = GONE, "no longer in DNS"
                if m.state == GONE and m.active == 0:
                    del self._members[address]
                    close = getattr(m.worker, "close", None)
                    if close is not None:
                        close()
                    log.info("%s pool: %s left", self.role, address)

    def poll(self) -> None:
        """Describes every member: its state and load. One pass; the monitor repeats it."""
        with self._lock:
            members = [m for m in self._members.values() if m.state != GONE]
        for m in members:
            broken = False
            info = None
            try:
                info = m.worker.describe()
                if (m.state in (JOINING, UNAVAILABLE, FAILED) or m.info is None) and self.accept is not None:
                    self.accept(info)
                state, message = (DRAINING, "shutting down") if info.draining else (SERVING, "")
            except ServiceError as exc:
                if exc.code == grpc.StatusCode.FAILED_PRECONDITION:
                    # from accept (it answered): its model does not pair; from Describe: the worker
                    # could not load its model, and says why
                    state = REFUSED if info is not None else FAILED
                else:
                    state = UNAVAILABLE
                    broken = exc.code == grpc.StatusCode.UNAVAILABLE  # no connection (refused, reset, keepalive)
                info, message = None, exc.message
            except Exception as exc:  # noqa: BLE001 - a member must never take the pool down
                info, state, message = None, UNAVAILABLE, f"{type(exc).__name__}: {exc}"
            with self._lock:
                if m.state == JOINING and state == UNAVAILABLE:
                    state = JOINING  # not up yet (a worker starting refuses connections a while): no news
                if m.state != state:  # a worker still starting is news, not a warning
                    level = logging.WARNING if m.state == SERVING or state in (REFUSED, FAILED) else logging.INFO
                    log.log(level, "%s pool: %s is %s %s", self.role, m.address, state, message)
                # its calls in flight are given up on once it surely stopped answering: its connection
                # is gone, or it missed two polls in a row (one late answer on a busy host is no fault)
                m.missed = m.missed + 1 if state in (UNAVAILABLE, JOINING) and info is None else 0
                stopped = state == UNAVAILABLE and (m.missed == 2 or (broken and m.missed == 1))
                if m.state == REFUSED and state != SERVING:
                    state, message = REFUSED, m.message  # stays refused until it serves an accepted model
                m.state, m.message = state, message
                if info is not None:
                    m.info = info
                    m.others = max(0, info.open_sessions - m.active)
                self._changed.notify_all()
            if stopped:
                self._abandon_calls(m)

    def _abandon_calls(self, m: Member) -> None:
        """The member stopped answering (its poll timed out or its connection broke: a cut link, a
        frozen host, a dead process): the calls waiting on it fail now and their requests move to
        another worker (placement.py), instead of each waiting out its deadline."""
        abandon = getattr(m.worker, "abandon_calls", None)
        if abandon is None:
            return
        cancelled = abandon(f"stopped answering ({m.message})")
        if cancelled:
            log.warning("%s pool: cancelled %d call(s) waiting on %s", self.role, cancelled, m.address)

    def start(self) -> None:
        """Resolves the entries and starts the monitor thread."""
        self._resolve_entries(self._entries)
        self._thread = threading.Thread(target=self._monitor, name=f"{self.role}-pool", daemon=True)
        self._thread.start()

    def _monitor(self) -> None:
        last_resolve = time.monotonic()
        while not self._stop.is_set():
            self.poll()
            if time.monotonic() - last_resolve >= self.resolve_s:
                self._forget_vanished(self._resolve_entries(self._entries))
                last_resolve = time.monotonic()
            self._stop.wait(self.next_poll_s())

    def next_poll_s(self) -> float:
        """poll_s, but at most JOINING_POLL_S while a member has not answered yet: a worker that is
        still starting serves as soon as it answers, not a whole --poll-interval later."""
        with self._lock:
            joining = any(m.state == JOINING for m in self._members.values())
        return min(self.poll_s, JOINING_POLL_S) if joining else self.poll_s

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            members, self._members = list(self._members.values()), {}
        for m in members:
            close = getattr(m.worker, "close", None)
            if close is not None:
                close()

    def wait_for_member(self, timeout_s: float) -> Member:
        """Blocks until a member serves. A member's answer that it cannot serve is final, so this
        does not wait out the timeout for it: LoadFailed if every member failed to load its model
        (the message names each and why), FailedPrecondition if every member was refused or failed,
        one refused at least; Unavailable on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                members = list(self._members.values())
                serving = [m for m in members if m.state == SERVING]
                if serving:
                    return serving[0]
                if members and all(m.state == FAILED for m in members):
                    raise LoadFailed("; ".join(m.message for m in members))
                if members and all(m.state in (REFUSED, FAILED) for m in members):
                    raise FailedPrecondition(next(m for m in members if m.state == REFUSED).message)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Unavailable(f"no {self.role} worker is serving after {timeout_s:.0f} s: {self.summary()}")
                self._changed.wait(min(left, 1.0))

    # ---- placement -----------------------------------------------------------------------

    def acquire(self, exclude: Iterable[str] = (), prefer: Member | None = None) -> Member:
        """The least-loaded serving member (not in exclude), or `prefer` while it serves (the
        choices of one request share its prompt's cache there), now holding one more session of ours."""
        exclude = set(exclude)
        with self._lock:
            serving = [m for m in self._members.values() if m.state == SERVING and m.address not in exclude]
            if not serving:
                raise Unavailable(f"no {self.role} worker is serving: {self.summary()}")
            member = prefer if prefer in serving else min(serving, key=lambda m: (m.load, m.placed))
            member.active += 1
            member.placed += 1
            return member

    def release(self, member: Member) -> None:
        with self._lock:
            member.active -= 1

    def report_failure(self, member: Member, exc: ServiceError) -> None:
        """A call to the member failed: no new sessions there until it answers a poll again."""
        with self._lock:
            if member.state == SERVING:
                member.state, member.message = UNAVAILABLE, f"{exc.code.name}: {exc.message}"
                log.warning("%s pool: %s failed a call (%s)", self.role, member.address, member.message)

    def members(self) -> list[Member]:
        with self._lock:
            return [Member(**m.__dict__) for m in self._members.values()]  # snapshots

    def first_info(self) -> ModelInfo | None:
        with self._lock:
            return next((m.info for m in self._members.values() if m.state == SERVING), None)

    def progress(self) -> str:
        """What each member is doing, for a request that waits on this pool at start-up, e.g.
        'the target worker at 10.0.0.7:50051 (model is still loading)'."""
        with self._lock:
            members = list(self._members.values())
        if not members:
            return f"the {self.role} workers at {', '.join(self._entries)} (not resolved yet)"
        doing = []
        for m in members:
            # a worker's own answer starts with its name (RemoteWorker.peer): said once here
            message = m.message.removeprefix(f"{self.role} worker at {m.address}: ")
            doing.append(f"{m.address} ({message or m.state})")
        return f"the {self.role} worker{'s' if len(members) > 1 else ''} at {'; '.join(doing)}"

    def summary(self) -> str:
        """One line per member; called with or without the lock (reads only)."""
        members = list(self._members.values())
        if not members:
            return f"no {self.role} worker configured" if not self._entries else f"{', '.join(self._entries)} resolved to nothing"
        return "; ".join(f"{m.address} {m.state}" + (f" ({m.message})" if m.message else "") for m in members)


def pair_pools(targets: WorkerPool, drafts: WorkerPool | None) -> None:
    """Every target must serve the model the first accepted target serves; every draft must share
    its vocabulary. A member that does not is REFUSED (and its message names both models)."""

    def accept_target(info: ModelInfo) -> None:
        with targets._lock:
            reference = targets.reference = targets.reference or info
        if (info.model_name, info.vocab_fingerprint) != (reference.model_name, reference.vocab_fingerprint):
            raise FailedPrecondition(
                f"target model '{info.model_name}' differs from '{reference.model_name}', which the other "
                f"targets serve: one pool serves one model"
            )

    def accept_draft(info: ModelInfo) -> None:
        if targets.reference is None:
            raise Unavailable("waiting for a target worker to pair with")
        check_pair(targets.reference, info)
        with drafts._lock:  # a request's draft fails over within its pool: every member drafts alike
            reference = drafts.reference = drafts.reference or info
        kind = lambda i: (i.draft_kind or "model", tuple(i.feature_layers))  # noqa: E731 - "": a worker before kinds
        if kind(info) != kind(reference):
            raise FailedPrecondition(
                f"draft '{info.model_name}' ({kind(info)[0]}) drafts otherwise than '{reference.model_name}' "
                f"({kind(reference)[0]}), which the other drafts serve: one pool serves one kind of draft")

    targets.accept = accept_target
    if drafts is not None:
        drafts.accept = accept_draft

"""A TCP proxy that puts a link with added latency between the orchestrator and a worker.

This machine's kernel has no `netem` qdisc (`tc qdisc add ... netem` says "unknown"), so
`specdec bench serve --link-rtt-ms` simulates hosts apart with this proxy instead: each chunk of
bytes read from one side is written to the other `rtt / 2` later, in order, without holding up the
chunks behind it (latency is added, bandwidth is not limited). It also counts, per direction, the
bytes it carries and the RPCs started through it: the HEADERS frames that open a stream, read from
the HTTP/2 frames the client sends (gRPC runs over HTTP/2 in cleartext here).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS = 0x1


@dataclass
class LinkCounts:
    rpcs: int = 0  # streams the client opened (HEADERS frames on new stream ids)
    bytes_up: int = 0  # client -> worker
    bytes_down: int = 0  # worker -> client

    def copy(self) -> "LinkCounts":
        return LinkCounts(self.rpcs, self.bytes_up, self.bytes_down)

    def __add__(self, other: "LinkCounts") -> "LinkCounts":
        return LinkCounts(self.rpcs + other.rpcs, self.bytes_up + other.bytes_up, self.bytes_down + other.bytes_down)

    def __sub__(self, other: "LinkCounts") -> "LinkCounts":
        return LinkCounts(self.rpcs - other.rpcs, self.bytes_up - other.bytes_up, self.bytes_down - other.bytes_down)


class FrameCounter:
    """Follows the HTTP/2 frames of the client's byte stream, counting the streams it opens."""

    def __init__(self):
        self._buf = b""
        self._preface = len(HTTP2_PREFACE)
        self._streams: set[int] = set()
        self.rpcs = 0

    def feed(self, data: bytes) -> None:
        if self._preface:
            skip = min(self._preface, len(data))
            data, self._preface = data[skip:], self._preface - skip
        self._buf += data
        while len(self._buf) >= 9:
            length = int.from_bytes(self._buf[:3], "big")
            if len(self._buf) < 9 + length:
                return
            kind, stream = self._buf[3], int.from_bytes(self._buf[5:9], "big") & 0x7FFFFFFF
            if kind == HEADERS and stream and stream not in self._streams:
                self._streams.add(stream)
                self.rpcs += 1
            self._buf = self._buf[9 + length:]


class DelayLink:
    """Listens on 127.0.0.1:<port> and forwards every connection to `upstream` (HOST:PORT) with
    rtt_ms / 2 added each way. Runs its own event loop on a daemon thread; stop() ends it."""

    def __init__(self, upstream: str, rtt_ms: float):
        self.upstream_host, port = upstream.rsplit(":", 1)
        self.upstream_port = int(port)
        self.delay_s = rtt_ms / 2000.0
        self.counts = LinkCounts()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._server = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"link-{upstream}", daemon=True)
        self._thread.start()
        ready.wait()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def snapshot(self) -> LinkCounts:
        with self._lock:
            return self.counts.copy()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        ready.set()
        self._loop.run_forever()
        tasks = asyncio.all_tasks(self._loop)  # stopped: end the connections' tasks, then the loop
        for task in tasks:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.close()

    def stop(self) -> None:
        def shutdown():
            self._server.close()
            self._loop.stop()

        self._loop.call_soon_threadsafe(shutdown)
        self._thread.join(timeout=5)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            worker_r, worker_w = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError:
            client_w.close()
            return
        frames = FrameCounter()
        await asyncio.gather(self._pipe(client_r, worker_w, frames), self._pipe(worker_r, client_w, None),
                             return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, frames: FrameCounter | None):
        """Reads chunks as they come and writes each delay_s after it was read, in order."""
        loop = asyncio.get_running_loop()
        due: asyncio.Queue = asyncio.Queue()

        async def deliver():
            while True:
                at, data = await due.get()
                if data is None:
                    break
                wait = at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while data := await reader.read(1 << 16):
                with self._lock:
                    if frames is not None:
                        before = frames.rpcs
                        frames.feed(data)
                        self.counts.rpcs += frames.rpcs - before
                        self.counts.bytes_up += len(data)
                    else:
                        self.counts.bytes_down += len(data)
                due.put_nowait((loop.time() + self.delay_s, data))
        except (ConnectionError, OSError):
            pass
        finally:
            due.put_nowait((0.0, None))
            try:
                await sender
            except (ConnectionError, OSError):
                pass
            writer.close()

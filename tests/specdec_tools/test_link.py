"""specdec_tools.link: the delaying proxy of `specdec bench serve --link-rtt-ms` carries gRPC calls to a
real worker unchanged and counts the RPCs and bytes that cross it."""

from __future__ import annotations

from specdec.protocol import SamplingParams
from specdec.wire import VerifyCall
from specdec.worker.config import WorkerConfig
from specdec_tools.link import HTTP2_PREFACE, FrameCounter, DelayLink
from tests.support.servers import HOST, create_target


def frame(kind: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, 0]) + stream.to_bytes(4, "big") + payload


def test_frame_counter_counts_streams_opened_across_chunk_boundaries():
    data = HTTP2_PREFACE + frame(4, 0, b"\0" * 6) + frame(1, 1, b"h" * 10) + frame(0, 1, b"d" * 30) \
        + frame(1, 3, b"h") + frame(1, 1, b"trailers") + frame(1, 5)
    counter = FrameCounter()
    for i in range(0, len(data), 7):  # fed in odd pieces, as TCP delivers them
        counter.feed(data[i:i + 7])
    assert counter.rpcs == 3  # streams 1, 3, 5; the second HEADERS on stream 1 opens nothing


def test_calls_through_the_link_are_answered_and_counted(target_engine):
    from orchestrator.remote import RemoteTarget

    server, port = create_target(WorkerConfig("target", "tiny", host=HOST), target_engine)
    link = DelayLink(f"{HOST}:{port}", rtt_ms=2)
    target = RemoteTarget(link.address)
    try:
        target.describe()
        target.open_session("via-link", [5, 6, 7])
        greedy = SamplingParams(temperature=0)
        v = target.verify_batch([VerifyCall("via-link", 3, [], [8], greedy)])[0]
        direct = target_engine.verify("via-link", 3, [], [8], greedy)
        assert v.argmax == direct.argmax
        target.close_session("via-link")
        counts = link.snapshot()
        assert counts.rpcs == 4  # Describe, OpenSession, VerifyBatch, CloseSession
        assert counts.bytes_up > 0 and counts.bytes_down > 0
    finally:
        target.close()
        link.stop()
        server.stop(None)

"""The SSE reader the meter and the stream guard share: the same events whatever the chunk boundaries."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.names import MAX_EVENT_BYTES
from extproc.sse import EventSplitter, MalformedStream, SseReader, event_data

STREAM = ('data: {"choices":[{"delta":{"content":"héllo"}}]}\n\n'
          'data: {"choices":[{"delta":{"content":" wörld"}}]}\r\n\r\n'
          ': a comment line, no data\n\n'
          'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\n'
          'data: [DONE]\n\n').encode()
EXPECTED = ['{"choices":[{"delta":{"content":"héllo"}}]}', '{"choices":[{"delta":{"content":" wörld"}}]}',
            '{"choices":[],"usage":{"prompt_tokens":3}}', "[DONE]"]


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_any_chunking_gives_the_same_events(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(STREAM)]
    reader = SseReader()
    got = [d for a, b in itertools.pairwise(bounds) for d in reader.feed(STREAM[a:b])]
    assert got == EXPECTED


def test_the_splitter_keeps_the_unfinished_event() -> None:
    events = EventSplitter()
    assert [event_data(e) for e in events.feed(b"data: 1\n\ndata: 2\r\n\r\ndata: 3")] == ["1", "2"]
    assert events.pending == len(b"data: 3")
    assert [event_data(e) for e in events.feed(b"\r")] == [] and [event_data(e) for e in events.feed(b"\r")] == ["3"]
    assert event_data(b": comment\n\n") is None


def reference_split(buf: bytearray) -> list[bytes]:
    """The splitter the gateway had before issue 27 (a whole-buffer search per event and separator, and
    a copy of the rest per event: quadratic), kept as the definition the new one is held to."""
    out: list[bytes] = []
    while True:
        cut, sep = -1, 0
        for s in (b"\n\n", b"\r\n\r\n", b"\r\r"):
            i = buf.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut, sep = i, len(s)
        if cut == -1:
            return out
        out.append(bytes(buf[: cut + sep]))
        del buf[: cut + sep]


# Streams of the bytes events and their ends are made of, cut anywhere.
PIECES = st.sampled_from([b"data: x", b"\n", b"\r", b"\r\n", b"\n\n", b"\r\r", b"\r\n\r\n", b":", b"y"])


@given(st.lists(PIECES, max_size=40), st.lists(st.integers(min_value=0, max_value=200), max_size=8))
def test_the_splitter_finds_what_the_reference_finds_however_the_stream_is_cut(pieces: list[bytes],
                                                                               cuts: list[int]) -> None:
    stream = b"".join(pieces)
    bounds = [0, *sorted(min(c, len(stream)) for c in cuts), len(stream)]
    splitter, ref_buf = EventSplitter(), bytearray()
    got, want = [], []
    for a, b in itertools.pairwise(bounds):
        got += splitter.feed(stream[a:b])
        ref_buf += stream[a:b]
        want += reference_split(ref_buf)
    assert got == want and splitter.pending == len(ref_buf)


@pytest.mark.parametrize("chunk", [1 << 20, 4096, 7], ids=["one write", "4 KiB chunks", "7-byte chunks"])
def test_splitting_is_linear_in_the_bytes_received(chunk: int) -> None:
    """Work counted, not timed: the bytes searched and copied per byte received stay the same whether
    the stream is 64 KiB or 4 MiB, sent in one write or in pieces (the old splitter searched and copied
    the rest of the buffer once per event: for 4 MiB in one write, about 2^40 bytes)."""
    event = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'
    per_byte = []
    for size in (64 << 10, (1 << 20) if chunk < 64 else (4 << 20)):
        stream = event * (size // len(event))
        splitter, n = EventSplitter(), 0
        for at in range(0, len(stream), chunk):
            n += len(splitter.feed(stream[at:at + chunk]))
        per_byte.append(splitter.work / len(stream))
        assert n == size // len(event)
    assert max(per_byte) <= 3.0 and per_byte[1] <= per_byte[0] * 1.05, per_byte


def test_an_event_without_end_beyond_the_limit_is_malformed() -> None:
    with pytest.raises(MalformedStream):
        list(SseReader().feed(b"data: " + b"x" * (MAX_EVENT_BYTES + 1)))

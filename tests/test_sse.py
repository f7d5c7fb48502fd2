"""The SSE reader the meter and the stream guard share: the same events whatever the chunk boundaries."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.sse import MAX_EVENT_BYTES, MalformedStream, SseReader, event_data, take_events

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


def test_take_events_keeps_the_unfinished_event() -> None:
    buf = bytearray(b"data: 1\n\ndata: 2\r\n\r\ndata: 3")
    assert [event_data(e) for e in take_events(buf)] == ["1", "2"]
    assert bytes(buf) == b"data: 3"
    assert event_data(b": comment\n\n") is None


def test_an_event_without_end_beyond_the_limit_is_malformed() -> None:
    with pytest.raises(MalformedStream):
        list(SseReader().feed(b"data: " + b"x" * (MAX_EVENT_BYTES + 1)))

"""Accounting's pure functions as tables (extproc/settlement/charge.py): what a settlement charges, and how
the ledger names the ending."""

from __future__ import annotations

from dataclasses import replace

import pytest
from google.protobuf import struct_pb2

from extproc.config import load_snapshot
from extproc.config.schema import Prices
from extproc.envoy_msgs import attr, count_attr
from extproc.names import Key
from extproc.settlement.access_log import logged_usage
from extproc.settlement.charge import (
    TOKEN_CLASSES,
    AttemptEnd,
    Ending,
    believed,
    charge_ending,
    charge_for,
    charge_lines,
    charge_of,
    earlier_charges,
    estimated,
    failure_charge,
    termination_of,
    token_classes,
    upstream_succeeded,
)
from extproc.store import Settlement
from tests.conftest import POLICY

SNAP = load_snapshot(POLICY)
DEP = SNAP.deployments["pool-llama-8b"]


@pytest.mark.parametrize(("status", "complete", "termination"), [
    (200, True, "complete"),
    (200, False, "stream_interrupted"),  # a stream that did not end normally (or was cut)
    (504, True, "deadline"),
    (504, False, "deadline"),
    (502, True, "upstream_error"),
    (429, False, "upstream_error"),
    (400, True, "upstream_error"),
])
def test_termination(status: int, complete: bool, termination: str) -> None:
    assert termination_of(status, complete) == termination


@pytest.mark.parametrize(("usage", "tokens", "micros"), [
    ({"prompt_tokens": 1000, "completion_tokens": 0}, 1000, 1000 * DEP.prices.input_per_mtok / 1e6),
    ({"prompt_tokens": 0, "completion_tokens": 1000}, 1000, 1000 * DEP.prices.output_per_mtok / 1e6),
    # cached prompt tokens at the cached price, never more of them than the prompt has
    ({"prompt_tokens": 1000, "completion_tokens": 0, "prompt_tokens_details": {"cached_tokens": 400}}, 1000,
     (600 * DEP.prices.input_per_mtok + 400 * DEP.prices.cached_input_per_mtok) / 1e6),
    ({"prompt_tokens": 10, "completion_tokens": 0, "prompt_tokens_details": {"cached_tokens": 99}}, 10,
     10 * DEP.prices.cached_input_per_mtok / 1e6),
    ({"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": None}, 10,
     (7 * DEP.prices.input_per_mtok + 3 * DEP.prices.output_per_mtok) / 1e6),
])
def test_charge_of_usage(usage: dict[str, object], tokens: int, micros: float) -> None:
    got_micros, got_tokens = charge_of(usage, DEP.prices)
    assert got_tokens == tokens and got_micros == -(-micros // 1)  # rounded up to a whole micro-unit


# Anthropic's list prices for one model, per million tokens in micro-dollars: writes 1.25x (5 minutes)
# and 2x (1 hour) the input, reads 0.1x; a reasoning rate of its own to tell the classes apart.
CLASSED = Prices(version="t", input_per_mtok=3_000_000, cached_input_per_mtok=300_000, output_per_mtok=15_000_000,
                 cache_write_per_mtok=3_750_000, cache_write_1h_per_mtok=6_000_000, reasoning_per_mtok=20_000_000)


@pytest.mark.parametrize(("usage", "classes"), [
    # OpenAI: cached input among the prompt tokens, reasoning among the completion tokens
    ({"prompt_tokens": 1000, "completion_tokens": 300, "prompt_tokens_details": {"cached_tokens": 400},
      "completion_tokens_details": {"reasoning_tokens": 200}},
     {"input": 600, "cached_input": 400, "output": 100, "reasoning": 200}),
    # Anthropic as the answer filter writes it: reads, 5-minute and 1-hour writes among the prompt tokens
    ({"prompt_tokens": 1000, "completion_tokens": 10, "prompt_tokens_details": {
        "cached_tokens": 500, "cache_write_tokens": 300, "cache_write_1h_tokens": 100}},
     {"input": 100, "cached_input": 500, "cache_write": 300, "cache_write_1h": 100, "output": 10}),
    # Bedrock: reads and writes (one rate); Gemini: thoughts among the output
    ({"prompt_tokens": 50, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 20,
                                                                           "cache_write_tokens": 30}},
     {"cached_input": 20, "cache_write": 30, "output": 5}),
    # a part larger than what is left of its whole is cut to it: the classes sum to the tokens
    ({"prompt_tokens": 10, "completion_tokens": 5, "prompt_tokens_details": {
        "cached_tokens": 6, "cache_write_tokens": 9, "cache_write_1h_tokens": 9},
      "completion_tokens_details": {"reasoning_tokens": 50}},
     {"cached_input": 6, "cache_write": 4, "reasoning": 5}),
])
def test_every_token_is_in_one_class_priced_at_its_rate(usage: dict[str, object], classes: dict[str, int]) -> None:
    got = token_classes(usage)
    assert {c: n for c, n in got.items() if n} == classes
    assert sum(got.values()) == usage["prompt_tokens"] + usage["completion_tokens"]  # type: ignore[operator]
    lines = charge_lines(usage, CLASSED)
    assert [(line["class"], line["tokens"]) for line in lines] == list(classes.items())
    micros, tokens = charge_of(usage, CLASSED)
    assert tokens == sum(classes.values())
    assert micros == -(-sum(n * CLASSED.per_mtok(c) for c, n in classes.items()) // 1_000_000)
    assert micros == -(-sum(line["tokens"] * line["per_mtok"] for line in lines) // 1_000_000)  # the lines add up


def test_a_class_without_its_own_rate_costs_what_its_provider_bills_it_as() -> None:
    """Writes cost input unless priced, 1-hour writes what other writes cost, reasoning costs output."""
    plain = Prices(version="p", input_per_mtok=3, cached_input_per_mtok=1, output_per_mtok=15)
    assert [plain.per_mtok(c) for c in TOKEN_CLASSES] == [3, 1, 3, 3, 15, 15]
    writes = plain.model_copy(update={"cache_write_per_mtok": 4})
    assert (writes.per_mtok("cache_write"), writes.per_mtok("cache_write_1h")) == (4, 4)


@pytest.mark.parametrize(("usage", "source", "termination", "status", "kind"), [
    (estimated(10, 5), "reported", "complete", 200, "actual"),  # the usage the engine reported, at the end
    (estimated(10, 5), "estimated", "complete", 200, "partial"),  # counted by the gateway
    (estimated(10, 5), "reported", "stream_interrupted", 200, "partial"),
    (estimated(10, 5), "reported", "client_cancel", 200, "partial"),
])
def test_a_charge_with_usage(usage: dict[str, int], source: str, termination: str, status: int, kind: str) -> None:
    micros, tokens, got = charge_for(usage, source, termination, status, DEP)
    assert (micros, tokens, got) == (*charge_of(usage, DEP.prices), kind)


@pytest.mark.parametrize(("status", "failed", "charge"), [
    (200, "released", (-1, -1, "ambiguous")),  # an answer without usage: the engine may have done it all
    (502, "released", (0, 0, "released")),
    (502, "ambiguous", (-1, -1, "ambiguous")),
])
def test_a_charge_without_usage(status: int, failed: str, charge: tuple[int, int, str]) -> None:
    assert charge_for(None, "none", "upstream_error", status, DEP, failed) == charge


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": -5, "completion_tokens": 3},  # would refund the budget
    {"prompt_tokens": 5, "completion_tokens": 2**60},  # would drain it
    {"prompt_tokens": 5, "completion_tokens": 1.5},
    {"prompt_tokens": 5, "completion_tokens": "3"},
    {"prompt_tokens": 5, "completion_tokens": True},
    {"prompt_tokens": 5, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": -1}},
    {"prompt_tokens": 5, "completion_tokens": 3, "prompt_tokens_details": {"cache_write_tokens": -2}},
    {"prompt_tokens": 5, "completion_tokens": 3, "prompt_tokens_details": {"cache_write_1h_tokens": 0.5}},
    {"prompt_tokens": 5, "completion_tokens": 3, "completion_tokens_details": {"reasoning_tokens": "2"}},
])
def test_usage_no_upstream_would_count_is_charged_as_unknown(usage: dict[str, object]) -> None:
    assert charge_for(*believed(usage, "reported"), "complete", 200, DEP) == (-1, -1, "ambiguous")
    assert charge_for(*believed(usage, "reported"), "upstream_error", 502, DEP) == (0, 0, "released")
    assert charge_for(*believed({"prompt_tokens": 5.0, "completion_tokens": 3}, "reported"), "complete", 200,
                      DEP)[2] == "actual"


def test_a_metadata_number_without_a_whole_value_reads_as_absent() -> None:
    md = struct_pb2.Struct()
    md.update({"inf": float("inf"), "nan": float("nan"), "neg": -5.0, "n": 7.0})
    assert (attr(md, "inf"), attr(md, "nan"), attr(md, "neg"), attr(md, "n")) == ("", "", "-5", "7")


def test_a_metadata_count_is_read_as_the_upstream_wrote_it() -> None:
    """What json_to_metadata (the JSON type kept) or the Lua stream guard (a whole number as a number,
    anything else as its text) put in the metadata: only a whole number reads as a count."""
    md = struct_pb2.Struct()
    md.update({"n": 7.0, "big": 1e300, "frac": 2.5, "inf": float("inf"), "text": "-7", "flag": True,
               "none": None, "obj": {"a": 1}})
    got = {k: count_attr(md, k) for k in ("n", "big", "frac", "text", "flag", "none", "obj", "absent")}
    assert got == {"n": 7, "big": int(1e300), "frac": 2.5, "text": "-7", "flag": True, "none": None,
                   "obj": "struct_value", "absent": None}
    assert count_attr(md, "inf") == float("inf")
    for key in ("big", "frac", "inf", "text", "flag", "obj"):
        usage, source = believed({"prompt_tokens": 3, "completion_tokens": count_attr(md, key)}, "reported")
        assert (usage, source) == (None, "unbelievable"), key
    assert believed({"prompt_tokens": 3, "completion_tokens": count_attr(md, "n")}, "reported")[1] == "reported"


def test_the_access_log_decodes_every_class_the_filters_left_and_no_class_they_did_not() -> None:
    """What settlement charges from the access log is the usage the filters read, class by class: a
    class the upstream did not report stays absent (not a 0 that would read as reported)."""
    md = struct_pb2.Struct()
    md.update({Key.USAGE_COMPLETION: 30.0, Key.USAGE_CACHED: 5.0, Key.USAGE_CACHE_WRITE_1H: 40.0,
               Key.USAGE_REASONING: 12.0})
    usage = logged_usage(md, 70)
    assert usage == {"prompt_tokens": 70, "completion_tokens": 30,
                     "prompt_tokens_details": {"cached_tokens": 5, "cache_write_1h_tokens": 40},
                     "completion_tokens_details": {"reasoning_tokens": 12}}
    assert {c: n for c, n in token_classes(usage).items() if n} == {
        "input": 25, "cached_input": 5, "cache_write_1h": 40, "output": 18, "reasoning": 12}
    md.update({Key.USAGE_CACHE_WRITE: "9"})  # not a count: the whole usage is not believed
    assert believed(logged_usage(md, 70), "reported") == (None, "unbelievable")


@pytest.mark.parametrize(("stream", "sent", "answered", "status", "charge"), [
    (False, False, False, 503, (0, 0, "released")),  # never reached an upstream
    (True, False, False, 503, (0, 0, "released")),
    (False, True, True, 502, (0, 0, "released")),  # the upstream answered an error status
    (True, True, True, 502, (0, 0, "released")),
    (False, True, False, 504, (-1, -1, "ambiguous")),  # a JSON answer may have been generated in full
    (False, True, False, 0, (-1, -1, "ambiguous")),  # (the client left before the headers)
])
def test_failures_are_charged_for_what_they_may_have_cost(stream: bool, sent: bool, answered: bool, status: int,
                                                          charge: tuple[int, int, str]) -> None:
    usage, failed = failure_charge(stream=stream, sent=sent, answered=answered, prompt_bound=100)
    assert charge_for(usage, "estimated", "upstream_error", status, DEP, failed) == charge


@pytest.mark.parametrize(("recorded", "answered", "status", "charge"), [
    ("200", True, 502, (-1, -1, "ambiguous")),  # 200, then a body too large for Envoy to read
    ("200", True, 504, (-1, -1, "ambiguous")),  # 200, then a body that stalled past the deadline
    ("201", True, 502, (-1, -1, "ambiguous")),
    ("503", True, 502, (0, 0, "released")),  # the upstream refused: nothing was done
    ("429", True, 502, (0, 0, "released")),
    ("", True, 502, (0, 0, "released")),  # no status recorded: as before, an answer is a refusal
    ("504", False, 504, (-1, -1, "ambiguous")),  # Envoy's own timeout, no upstream headers: JSON may be whole
    ("200", False, 502, (-1, -1, "ambiguous")),  # a 200 no upstream sent (Envoy's own) is not believed
])
def test_an_upstreams_2xx_is_charged_as_the_work_it_was_whatever_envoy_did_after(
        recorded: str, answered: bool, status: int, charge: tuple[int, int, str]) -> None:
    """Issue 27, item 3: the engine answered 200 and generated 4,096 tokens, Envoy could not carry the
    body (response_payload_too_large) and the client got 502 - which settled as released (0)."""
    usage, failed = failure_charge(stream=False, sent=True, answered=answered, prompt_bound=100,
                                   succeeded=upstream_succeeded(recorded, answered))
    assert charge_for(usage, "estimated", "upstream_error", status, DEP, failed) == charge


def test_a_stream_whose_upstream_said_200_pays_its_prompt_at_least() -> None:
    usage, kind = failure_charge(stream=True, sent=True, answered=True, prompt_bound=1000,
                                 succeeded=upstream_succeeded("200", True))
    assert usage == {"prompt_tokens": 1000, "completion_tokens": 0} and kind == "partial"


def test_a_stream_sent_but_never_answered_pays_its_prompt_only() -> None:
    usage, kind = failure_charge(stream=True, sent=True, answered=False, prompt_bound=1000)
    assert usage == {"prompt_tokens": 1000, "completion_tokens": 0} and kind == "partial"
    micros, tokens, kind = charge_for(usage, "estimated", "stream_interrupted", 504, DEP, kind)
    assert (tokens, kind) == (1000, "partial") and micros == -(-1000 * DEP.prices.input_per_mtok // 10**6)


# An access-log entry, decoded (extproc/settlement/access_log.py `ending_of`), decides its charge alone
# (accounting.charge_ending): each row is one way an exchange ends.
USAGE = {"prompt_tokens": 100, "completion_tokens": 20, "prompt_tokens_details": {"cached_tokens": 0}}
JSON_200 = Ending(status=200, stream=False, prompt_bound=150, usage=USAGE, sent=True, answered=True,
                  upstream_status="200")
STREAM_200 = Ending(status=200, stream=True, prompt_bound=150, usage=USAGE, chunks=20, stream_done=True, sent=True,
                    answered=True, upstream_status="200")


@pytest.mark.parametrize(("logged", "termination", "kind", "source", "tokens"), [
    (JSON_200, "complete", "actual", "reported", 120),
    (STREAM_200, "complete", "actual", "reported", 120),
    # A stream without usage (the client did not ask): its prompt bound and the guard's chunks.
    (replace(STREAM_200, usage=None), "complete", "partial", "estimated", 170),
    # The guard saw no normal end: interrupted, charged for what was generated.
    (replace(STREAM_200, usage=None, stream_done=False), "stream_interrupted", "partial", "estimated", 170),
    # The client left mid-stream: a cancel; right after the last chunk: complete.
    (replace(STREAM_200, usage=None, stream_done=False, client_closed=True), "client_cancel", "partial",
     "estimated", 170),
    (replace(STREAM_200, client_closed=True), "complete", "actual", "reported", 120),
    # A JSON answer past Envoy's timeout: the deadline, and it may have been generated in full.
    (replace(JSON_200, status=504, usage=None, answered=False, upstream_timeout=True, upstream_status=""),
     "deadline", "ambiguous", "none", -1),
    # Never reached an upstream / refused by it: nothing was done.
    (replace(JSON_200, status=503, usage=None, sent=False, answered=False, upstream_status=""), "upstream_error",
     "released", "none", 0),
    (replace(JSON_200, status=502, usage=None, upstream_status="429"), "upstream_error", "released", "none", 0),
    # The upstream said 200 and Envoy could not carry the body: the work was done.
    (replace(JSON_200, status=502, usage=None), "upstream_error", "ambiguous", "none", -1),
    # A 2xx a Lua filter found broken and answered as 502: ambiguous, never released.
    (replace(JSON_200, status=502, usage=None, broken=True), "upstream_error", "ambiguous", "none", -1),
    # Its own filter never settled it (the backstop): no usage believed, the whole reservation.
    (replace(JSON_200, backstop=True), "unknown", "ambiguous", "none", -1),
    # A count no upstream gives: not believed.
    (replace(JSON_200, usage={"prompt_tokens": 3, "completion_tokens": -7}), "complete", "ambiguous",
     "unbelievable", -1),
    # Envoy's degraded answer, no upstream answered: nothing generated, nothing charged.
    (Ending(status=200, stream=False, prompt_bound=150, degraded_response=True), "degraded", "released", "none", 0),
    # What a response filter saw itself (the meter, the ext_proc stream guard): an answer the checks
    # refused was generated whole - its usage is the charge, the client got 502 ...
    (replace(JSON_200, rejected=True), "answer_rejected", "actual", "reported", 120),
    (replace(STREAM_200, rejected=True, stream_done=False), "answer_rejected", "actual", "reported", 120),
    # ... a 2xx its filter could not read (broken), refused: ambiguous ...
    (replace(JSON_200, usage=None, rejected=True, broken=True), "upstream_error", "ambiguous", "none", -1),
    # ... and an answer whose end Envoy cut before the filter saw it.
    (replace(JSON_200, whole=False), "stream_interrupted", "partial", "reported", 120),
])
def test_an_ending_decides_its_charge(logged: Ending, termination: str, kind: str, source: str,
                                      tokens: int) -> None:
    """Every settlement after an answer - the access log's, the meter's, the ext_proc stream guard's -
    decodes what it saw into an Ending and charges it here: one rule."""
    c = charge_ending(logged, DEP)
    assert (c.termination, c.kind, c.source, c.tokens) == (termination, kind, source, tokens)
    assert c.status == (502 if logged.rejected else logged.status)
    assert c.micros == (-1 if tokens == -1 else charge_of(c.usage, DEP.prices)[0] if c.usage else 0)
    assert c.degraded == (termination == "degraded")


COUNT_200 = replace(JSON_200, usage={"prompt_tokens": 42, "completion_tokens": 0,
                                     "prompt_tokens_details": {"cached_tokens": 0}}, count=True)


@pytest.mark.parametrize(("logged", "termination"), [
    (COUNT_200, "complete"),  # counted: the count is its usage, charged nothing
    (replace(COUNT_200, status=502, usage=None, broken=True), "upstream_error"),  # a count that could not be read
    (replace(COUNT_200, status=502, usage=None, upstream_status="429"), "upstream_error"),
    (replace(COUNT_200, status=504, usage=None, upstream_timeout=True, answered=False), "deadline"),
])
def test_a_token_count_is_charged_nothing(logged: Ending, termination: str) -> None:
    """A door's token count generates nothing: whatever happened, its reservation (of zero) is released
    at nothing, never ambiguous - even where a generation would have been charged in full - and it has
    no usage."""
    c = charge_ending(logged, DEP)
    assert (c.termination, c.kind, c.micros, c.tokens) == (termination, "released", 0, 0)
    assert c.usage is None  # the count is recorded beside usage: no reader sums it as tokens processed


UNANSWERED = (7, 40)  # what one attempt sent and never answered costs, as the reservation holds it
UT, UF = ("UT",), ("UF",)


@pytest.mark.parametrize(("count", "ends", "unanswered", "charged", "lines"), [
    # One attempt: nothing before it.
    (1, {}, UNANSWERED, (0, 0), []),
    # Sent, no headers within its limit: may have run whole - its bound, as `unknown`.
    (2, {1: AttemptEnd(1, 0, True, UT)}, UNANSWERED, UNANSWERED, [(1, 0, "unknown", 7)]),
    # Answered an error: it said what it did (nothing).
    (2, {1: AttemptEnd(1, 503, True)}, UNANSWERED, (0, 0), [(1, 503, "released", 0)]),
    # Never reached an upstream (a refused connection): ran nothing.
    (2, {1: AttemptEnd(1, 0, False, UF)}, UNANSWERED, (0, 0), [(1, 0, "released", 0)]),
    # Not in the log (a response filter settles, or the entry was lost): may have run.
    (3, {2: AttemptEnd(2, 429, True)}, UNANSWERED, UNANSWERED, [(1, 0, "unknown", 7), (2, 429, "released", 0)]),
    # The route retries no attempt that may have run: the earlier ones failed before sending or said so.
    (3, {}, None, (0, 0), [(1, 0, "released", 0), (2, 0, "released", 0)]),
    # Envoy's count is 0 when no attempt was made at all.
    (0, {}, UNANSWERED, (0, 0), []),
])
def test_each_earlier_attempt_is_charged_what_it_may_have_cost(
        count: int, ends: dict[int, AttemptEnd], unanswered: tuple[int, int] | None, charged: tuple[int, int],
        lines: list[tuple[int, int, str, int]]) -> None:
    got, micros, tokens = earlier_charges(count, ends, unanswered)
    assert (micros, tokens) == charged
    assert [(a["n"], a["status"], a["settlement"], a["charged_micros"]) for a in got] == lines


def test_a_settlement_that_knows_its_attempts_charges_one_bound_for_an_unknown_answer() -> None:
    hint = '{"e":[20,100,7,40]}'  # one answer's bound 20 micros; an unanswered attempt's 7
    assert Settlement("t", "r", {}, -1, -1, hint=hint, earlier=(14, 80)).amounts() == (34, 180)
    assert Settlement("t", "r", {}, 5, 30, hint=hint, earlier=(7, 40)).amounts() == (12, 70)
    # Attempts not known (the sweeper): the whole reservation, whatever it holds.
    assert Settlement("t", "r", {}, -1, -1, hint=hint).amounts() == (-1, -1)
    # A reservation of one attempt: an unknown answer is the whole of it.
    assert Settlement("t", "r", {}, -1, -1, hint='{"p":3}', earlier=(0, 0)).amounts() == (-1, -1)
    # The key of an unknown answer stays ambiguous either way.
    assert Settlement("t", "r", {}, -1, -1, hint=hint, earlier=(0, 0)).idempotency[0] == "ambiguous"

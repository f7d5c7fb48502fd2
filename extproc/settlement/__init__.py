"""Settlement: every reservation ends exactly once (invariant 4), with one ledger entry
(invariant 8), written by the same store script; the first settlement of a request wins. Whoever saw
an exchange end decodes what it saw into one record (charge.Ending) and charges it by one pure rule
(charge.charge_ending); the result is one typed Settlement (extproc/store) sent through the Settler.

Its modules: charge (the pure rule and the ledger's settlement half), settler (to the store),
access_log (Envoy's access log), meter (the response filters' own settlements), releases (requests
no upstream answered), observe (metrics and spans of what the store kept), sweeper (expired leases).

- JSON answers: Envoy's gRPC access log (SettlementLog), usage copied into metadata by
  json_to_metadata.
- Streams: the access log too, usage (and how the stream ended, and the chunks generated so far)
  written into the metadata by the Lua stream guard in Envoy (extproc/lua/stream_guard.lua).
- Idempotent streams: ext_proc's stream guard (extproc/service/streams.py) settles through the Meter's
  settle_stream, after recording what the client received for replay.
- Idempotent JSON answers: the meter, a blocking ext_proc filter on the response body that records
  the answer for replay and settles before the answer's last chunk reaches the client, so a repeat
  of the key that follows the answer is replayed, never run again.
- Everything Envoy saw fail (an error status, a cut stream, a client gone) settles from the access
  log at once, whoever else would have settled it; for a stream or an idempotent answer that ended
  normally, the access log settles only as a backstop, if its filter never did (a worker died).
- What a failure is charged (`failure_charge`): nothing when the upstream never got the request or
  answered with an error status; for a request it got but never answered - or answered 2xx before
  Envoy failed the answer (too large to read, a body that stalled: `upstream_status`) - the prompt's
  bound when it was a stream (nothing was generated before the first byte) and the whole
  reservation, marked `ambiguous`, for a JSON answer (the engine may have generated it all). Either
  way settled at once; an ambiguous one keeps its Idempotency-Key ambiguous (invariant 21).
- Not processed: Envoy's own 503 when no decision reached it (`_release_unprocessed`) releases what
  a worker reserved for the request at once.
- Release: a request refused after it reserved (a later stage failed) is released, charge 0.
- The sweeper: a reservation whose lease expired (the gateway lost track: crash, lost access log)
  is charged in full and marked `ambiguous`, so a crashed gateway never frees money it may have spent.
"""

package llmgw.examples.time_window_test

import rego.v1

import data.llmgw.examples.time_window.reasons

batch := {"request": {"route": "chat-batch"}}

# time.now_ns is replaced by a fixed instant in each test, as `opa test` allows.
tuesday_noon := time.parse_rfc3339_ns("2026-12-01T12:00:00Z")

tuesday_night := time.parse_rfc3339_ns("2026-12-01T22:30:00Z")

saturday_noon := time.parse_rfc3339_ns("2026-12-05T12:00:00Z")

test_open_on_a_weekday_at_noon if {
	count(reasons) == 0 with input as batch with time.now_ns as tuesday_noon
}

test_closed_at_night if {
	some msg in reasons with input as batch with time.now_ns as tuesday_night
	startswith(msg, "route chat-batch is open Friday,Monday,Thursday,Tuesday,Wednesday 07:00-19:00")
}

test_closed_on_saturday if {
	count(reasons) == 1 with input as batch with time.now_ns as saturday_noon
}

test_other_routes_are_always_open if {
	count(reasons) == 0 with input as {"request": {"route": "chat-default"}} with time.now_ns as saturday_noon
}

package llmgw.examples.withdrawn_test

import rego.v1

import data.llmgw.examples.withdrawn.reasons

legacy := {"request": {"route": "chat-legacy"}}

test_refused_while_withdrawn if {
	some msg in reasons with input as legacy with time.now_ns as time.parse_rfc3339_ns("2027-01-15T00:00:00Z")
	contains(msg, "withdrawn until 2027-03-31T00:00:00Z")
}

test_served_again_after_the_date if {
	count(reasons) == 0 with input as legacy with time.now_ns as time.parse_rfc3339_ns("2027-04-01T00:00:00Z")
}

test_other_routes_unaffected if {
	count(reasons) == 0 with input as {"request": {"route": "chat-default"}}
}

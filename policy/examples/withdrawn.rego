# A temporary deny of a withdrawn model: a route is refused until a date (a regulatory withdrawal, a
# provider incident), with the reason and the date in the refusal. Remove the entry to lift it.
package llmgw.examples.withdrawn

import rego.v1

withdrawn := {"chat-legacy": {"until": "2027-03-31T00:00:00Z", "why": "the provider withdrew the model in the EU"}}

reasons contains msg if {
	some w in [withdrawn[input.request.route]]
	time.now_ns() < time.parse_rfc3339_ns(w.until)
	msg := sprintf("route %s is withdrawn until %s: %s", [input.request.route, w.until, w.why])
}

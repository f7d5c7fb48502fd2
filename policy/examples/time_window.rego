# A time window: a route open only on weekdays between 07:00 and 19:00 UTC (batch jobs outside the
# window go elsewhere). `time.*` makes the decision depend on the clock, so a policy using it is not
# served from the decision cache.
package llmgw.examples.time_window

import rego.v1

windows := {"chat-batch": {"days": {"Monday", "Tuesday", "Wednesday", "Thursday", "Friday"}, "from": 7, "to": 19}}

reasons contains msg if {
	some window in [windows[input.request.route]]
	not open(window, time.now_ns())
	msg := sprintf("route %s is open %s %02d:00-%02d:00 UTC", [
		input.request.route, concat(",", sort([d | some d in window.days])), window.from, window.to,
	])
}

open(window, now) if {
	time.weekday(now) in window.days
	[hour, _, _] := time.clock(now)
	hour >= window.from
	hour < window.to
}

# Tool calls a model returns, decided before the caller can act on them: package llmgw.answers,
# entry point `decision`. The gateway evaluates it for every call in an answer (JSON or stream) once
# the call is complete and its arguments satisfy the offered tool's schema.
#
# input    identity (as for authz), request.route / request_class / data_class, and the call:
#          call.name, call.known (listed in the tool catalog), call.effects (its entry's, or the
#          unlisted rule's defaults it was offered with), call.arguments (the model's arguments, parsed)
# data     data.gateway, as for authz
# decision {"allow": bool, "reasons": [string]}
#
# A syntactically valid request to move money is still an authorization decision: a refund over the
# limit is refused here even though the caller may offer the tool.
package llmgw.answers

import rego.v1

# The most one refund may move, per currency, without the `payment_large` effect.
refund_limits := {"EUR": 500, "USD": 500, "GBP": 400}

default allow := false

allow if count(reasons) == 0

# The call's effects need the caller's grant, as the offer did (a tool the model names without the
# request offering it never gets here: the gateway refuses such a call before asking).
reasons contains msg if {
	some effect in input.call.effects
	not effect in input.identity.effects
	msg := sprintf("the call to %s needs the %s effect, which the caller is not granted (rule: effect grants)", [input.call.name, effect])
}

# (An unlisted tool was decided when the request offered it, by authz.rego's unlisted rule: the call
# carries the default effects it was admitted with, checked above.)

# Refunds: a known currency, a positive amount, and at most the currency's limit.
reasons contains "a refund must name a currency with a limit" if {
	input.call.name == "issue_refund"
	not refund_limits[input.call.arguments.currency]
}

reasons contains "a refund's amount must be a positive number" if {
	input.call.name == "issue_refund"
	not positive(input.call.arguments.amount)
}

reasons contains "the refund is over the limit for its currency" if {
	input.call.name == "issue_refund"
	not "payment_large" in input.identity.effects
	input.call.arguments.amount > refund_limits[input.call.arguments.currency]
}

positive(x) if {
	is_number(x)
	x > 0
}

decision := {"allow": allow, "reasons": reasons}

package llmgw.answers_test

import rego.v1

import data.llmgw.answers.decision

refund(amount, currency, effects) := {
	"identity": {"tenant": "acme", "subject": "k1", "kind": "api_key", "groups": [], "effects": effects},
	"request": {"route": "chat-default", "request_class": "read_only_chat", "data_class": "internal"},
	"call": {
		"name": "issue_refund", "known": true, "effects": ["payment"],
		"arguments": {"order_id": "A-1", "amount": amount, "currency": currency},
	},
}

test_a_refund_within_the_limit_is_allowed if {
	decision.allow with input as refund(120, "EUR", ["payment"])
}

test_the_limit_itself_is_allowed if {
	decision.allow with input as refund(500, "USD", ["payment"])
}

test_a_refund_over_the_limit_is_refused if {
	not decision.allow with input as refund(500.01, "EUR", ["payment"])
	decision.reasons == {"the refund is over the limit for its currency"} with input as refund(9000, "EUR", ["payment"])
}

test_payment_large_lifts_the_limit if {
	decision.allow with input as refund(9000, "EUR", ["payment", "payment_large"])
}

test_an_unknown_currency_is_refused if {
	decision.reasons == {"a refund must name a currency with a limit"} with input as refund(10, "XYZ", ["payment"])
}

test_a_negative_or_textual_amount_is_refused if {
	not decision.allow with input as refund(-5, "EUR", ["payment"])
	not decision.allow with input as refund("100", "EUR", ["payment"])
}

test_the_effect_needs_the_callers_grant if {
	decision.reasons == {"the call to issue_refund needs the payment effect, which the caller is not granted (rule: effect grants)"} with input as refund(10, "EUR", [])
}

test_other_tools_are_allowed_with_their_effects if {
	decision.allow with input as {
		"identity": {"effects": []},
		"call": {"name": "search_docs", "known": true, "effects": [], "arguments": {"q": "x"}},
	}
}

# An unlisted tool reaches an answer only when the offer's unlisted rule admitted it: the call is held
# to the default effects it was admitted with.
test_an_admitted_unlisted_tool_keeps_its_default_effects if {
	decision.allow with input as {
		"identity": {"effects": ["execute"]},
		"call": {"name": "run_query", "known": false, "effects": ["execute"], "arguments": {}},
	}
	not decision.allow with input as {
		"identity": {"effects": []},
		"call": {"name": "run_query", "known": false, "effects": ["execute"], "arguments": {}},
	}
}

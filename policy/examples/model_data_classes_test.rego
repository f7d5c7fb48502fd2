package llmgw.examples.model_data_classes_test

import rego.v1

import data.llmgw.examples.model_data_classes.reasons

test_experimental_route_takes_public_data if {
	count(reasons) == 0 with input as {"request": {"route": "chat-experimental", "data_class": "public"}}
}

test_experimental_route_refuses_internal_data if {
	"route chat-experimental may not carry internal data" in reasons with input as {"request": {
		"route": "chat-experimental", "data_class": "internal",
	}}
}

test_an_unlisted_route_is_not_limited if {
	count(reasons) == 0 with input as {"request": {"route": "chat-other", "data_class": "restricted"}}
}

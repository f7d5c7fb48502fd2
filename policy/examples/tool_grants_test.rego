package llmgw.examples.tool_grants_test

import rego.v1

import data.llmgw.examples.tool_grants.reasons

asking(groups, tools) := {
	"identity": {"groups": groups},
	"request": {"tools": [{"name": t, "known": true, "effects": []} | some t in tools]},
}

test_support_may_update_tickets if {
	count(reasons) == 0 with input as asking(["support"], ["update_ticket", "lookup_order"])
}

test_support_may_not_refund if {
	reasons == {"tool issue_refund is not granted to any of the caller's teams"} with input as asking(
		["support"],
		["issue_refund"],
	)
}

test_a_second_team_adds_its_grants if {
	count(reasons) == 0 with input as asking(["support", "finance"], ["issue_refund", "update_ticket"])
}

test_no_team_no_tools if {
	count(reasons) == 1 with input as asking([], ["lookup_order"])
}

test_grants_come_from_data_and_can_be_replaced if {
	count(reasons) == 0 with input as asking(["ops"], ["restart"]) with data.llmgw.examples.tool_grants.grants as {"ops": {"restart"}}
}

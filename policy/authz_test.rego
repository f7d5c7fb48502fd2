# Tests for authz.rego. `llmgw policy test policy` runs every test_* rule; a rule test_X runs with
# the input document input_X of the same package, when there is one.
package llmgw.authz_test

import rego.v1

import data.llmgw.authz

acme := {"tenant": "acme", "subject": "k", "kind": "api_key", "groups": [], "effects": []}

route := {"name": "chat-default", "request_class": "read_only_chat"}

candidates := [{"deployment": "pool-llama-8b", "data_classes": ["public", "internal", "confidential"], "regions": ["eu"]}]

chat := {"route": "chat-default", "data_class": "internal", "tools": [], "stream": false}

input_plain_chat_allowed := {"identity": acme, "request": chat, "route": route, "candidates": candidates}

test_plain_chat_allowed if {
	authz.decision.allow
	count(authz.decision.reasons) == 0
}

# object.union merges one level here (regopy 1.5), so each part is merged on its own.
with_identity(extra) := object.union(input_plain_chat_allowed, {"identity": object.union(acme, extra)})

with_request(extra) := object.union(input_plain_chat_allowed, {"request": object.union(chat, extra)})

input_unknown_tenant_denied := with_identity({"tenant": "initech"})

test_unknown_tenant_denied if {
	not authz.decision.allow
	"tenant initech is not configured" in authz.decision.reasons
}

input_tenant_class_not_allowed := object.union(input_plain_chat_allowed, {
	"identity": object.union(acme, {"tenant": "globex"}),
	"request": object.union(chat, {"data_class": "confidential"}),
})

test_tenant_class_not_allowed if {
	not authz.decision.allow
	"tenant globex may not send data class confidential" in authz.decision.reasons
}

input_no_candidate_serves_class := with_request({"data_class": "restricted"})

test_no_candidate_serves_class if {
	not authz.decision.allow
	"tenant acme may not send data class restricted" in authz.decision.reasons
	"route chat-default has no candidate for data class restricted in the tenant's regions" in authz.decision.reasons
}

write_tool := [{"name": "update_ticket", "known": true, "effects": ["write"]}]

input_write_tool_without_grant := with_request({"tools": write_tool})

test_write_tool_without_grant if {
	not authz.decision.allow
	"tool update_ticket needs the write effect, which the caller is not granted" in authz.decision.reasons
}

input_write_tool_with_grant := object.union(input_write_tool_without_grant, {
	"identity": object.union(acme, {"effects": ["write"]}),
})

test_write_tool_with_grant if authz.decision.allow

input_unknown_tool_denied := with_request({"tools": [{"name": "rm_rf", "known": false, "effects": []}]})

test_unknown_tool_denied if {
	not authz.decision.allow
	"tool rm_rf is not in the tool catalog" in authz.decision.reasons
}

input_internal_is_redacted := input_plain_chat_allowed

test_internal_is_redacted if {
	"email" in authz.decision.obligations.redact
	not authz.decision.obligations.record_content
}

input_public_recordable := with_request({"data_class": "public"})

test_public_recordable if {
	count(authz.decision.obligations.redact) == 0
	authz.decision.obligations.record_content
}

# Tests for authz.rego, written as for `opa test`: each test states its input with `with input as`
# and may replace gateway facts with `with data.gateway... as`. `llmgw policy test policy` runs them.
package llmgw.authz_test

import rego.v1

import data.llmgw.authz

acme := {"tenant": "acme", "subject": "k", "kind": "api_key", "groups": [], "effects": []}

chat := {
	"route": "chat-default", "data_class": "internal", "tools": [], "stream": false, "client": null,
	"unlisted_tools": {"rule": "refuse", "effects": [], "set_by": "tenant acme"},
}

allowed := {
	"identity": acme,
	"request": chat,
	"route": {"name": "chat-default", "request_class": "read_only_chat"},
	"candidates": [{"deployment": "pool-llama-8b", "data_classes": ["public", "internal", "confidential"], "regions": ["eu"]}],
}

# object.union merges objects recursively: only the fields named change.
with_request(fields) := object.union(allowed, {"request": fields})

test_plain_chat_allowed if {
	d := authz.decision with input as allowed
	d.allow
	count(d.reasons) == 0
}

test_unknown_tenant_denied if {
	d := authz.decision with input as object.union(allowed, {"identity": {"tenant": "initech"}})
	not d.allow
	"tenant initech is not configured" in d.reasons
}

test_tenant_class_not_allowed if {
	d := authz.decision with input as object.union(allowed, {
		"identity": {"tenant": "globex"},
		"request": {"data_class": "confidential"},
	})
	not d.allow
	"tenant globex may not send data class confidential" in d.reasons
}

test_no_candidate_serves_class if {
	d := authz.decision with input as with_request({"data_class": "restricted"})
	not d.allow
	"tenant acme may not send data class restricted" in d.reasons
	"route chat-default has no candidate for data class restricted in the tenant's regions" in d.reasons
}

test_a_region_the_tenant_does_not_allow_has_no_candidate if {
	d := authz.decision with input as allowed with data.gateway.tenants.acme.regions as ["us"]
	not d.allow
	"route chat-default has no candidate for data class internal in the tenant's regions" in d.reasons
}

write_tool := [{"name": "update_ticket", "known": true, "effects": ["write"]}]

test_write_tool_without_grant if {
	d := authz.decision with input as with_request({"tools": write_tool})
	not d.allow
	"tool update_ticket needs the write effect, which the caller is not granted (rule: effect grants)" in d.reasons
}

test_write_tool_with_grant if {
	authz.allow with input as object.union(with_request({"tools": write_tool}), {"identity": {"effects": ["write"]}})
}

test_unknown_tool_denied if {
	d := authz.decision with input as with_request({"tools": [{"name": "rm_rf", "known": false, "effects": []}]})
	not d.allow
	"tool rm_rf is not in the tool catalog, and tenant acme refuses unlisted tools (rule: unlisted tools)" in d.reasons
}

# An unlisted tool admitted by its rule is held to the rule's default effects, like a listed one.
admitted_unlisted := {"unlisted_tools": {"rule": "admit", "effects": ["execute"], "set_by": "route chat-default"}}

test_an_admitted_unlisted_tool_needs_its_default_effects if {
	tool := {"name": "run_query", "known": false, "effects": ["execute"]}
	d := authz.decision with input as with_request(object.union(admitted_unlisted, {"tools": [tool]}))
	d.reasons == {"tool run_query needs the execute effect, which the caller is not granted (rule: effect grants)"}
	authz.allow with input as object.union(with_request(object.union(admitted_unlisted, {"tools": [tool]})),
		{"identity": {"effects": ["execute"]}})
}

agent_tools := [
	{"name": "Read", "known": true, "effects": ["read"]},
	{"name": "Bash", "known": true, "effects": ["execute"]},
	{"name": "WebFetch", "known": true, "effects": ["network"]},
]

coder := {"identity": {"effects": ["read", "execute", "network"]}}

test_an_agent_with_granted_effects_on_internal_data if {
	authz.allow with input as object.union(with_request({"tools": agent_tools}), coder)
}

test_confidential_data_never_reaches_execution_or_the_network if {
	doc := object.union(with_request({"tools": agent_tools, "data_class": "confidential"}), coder)
	d := authz.decision with input as doc
	d.reasons == {
		"tool Bash has the execute effect, which confidential data may not reach (rule: effects by data class)",
		"tool WebFetch has the network effect, which confidential data may not reach (rule: effects by data class)",
	}
	authz.allow with input as object.union(with_request({"tools": [agent_tools[0]], "data_class": "confidential"}), coder)
}

test_internal_is_redacted if {
	d := authz.decision with input as allowed
	"email" in d.obligations.redact
	not d.obligations.record_content
}

test_public_recordable if {
	d := authz.decision with input as with_request({"data_class": "public"})
	count(d.obligations.redact) == 0
	d.obligations.record_content
}

test_redaction_follows_the_configured_class if {
	d := authz.decision with input as allowed with data.gateway.redaction.from_data_class as "confidential"
	count(d.obligations.redact) == 0
}

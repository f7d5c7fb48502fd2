# Authorization for every chat request: package llmgw.authz, entry point `decision`.
#
# input    the request, identity and route facts ext_proc sends (policy/README.md lists every field)
# data     data.gateway: data classes in order, tenants, the tool catalog, redaction settings
#          (built from gateway.yaml with each config revision)
# decision {"allow": bool, "reasons": [string], "obligations": {"redact": [entity], "record_content": bool}}
#
# Deny by default: a request is allowed only when no rule below finds a reason to refuse it.
package llmgw.authz

import rego.v1

default allow := false

allow if {
	tenant
	count(reasons) == 0
}

tenant := data.gateway.tenants[input.identity.tenant]

reasons contains msg if {
	not tenant
	msg := sprintf("tenant %s is not configured", [input.identity.tenant])
}

# A tenant may send only the data classes it is allowed.
reasons contains msg if {
	tenant
	not input.request.data_class in tenant.allowed_data_classes
	msg := sprintf("tenant %s may not send data class %s", [input.identity.tenant, input.request.data_class])
}

# Some candidate of the route must serve the data class in a region the tenant allows. (ext_proc's
# router enforces the same per candidate; this makes the refusal a 403 with a reason.)
reasons contains msg if {
	tenant
	not any_candidate_serves
	msg := sprintf("route %s has no candidate for data class %s in the tenant's regions", [input.route.name, input.request.data_class])
}

any_candidate_serves if {
	some c in input.candidates
	input.request.data_class in c.data_classes
	tenant.regions == null
}

any_candidate_serves if {
	some c in input.candidates
	input.request.data_class in c.data_classes
	some region in c.regions
	region in tenant.regions
}

# Tools and their effects. Each offered tool arrives resolved by the catalog for the request's client
# (gateway.yaml `tools` and `tool_packs`): `known` when an entry lists it, with that entry's effects;
# an unlisted one with the unlisted rule's default effects when that rule admits it. Every refusal
# names the tool and the rule that refused it.
#
# Effects: read, edit, execute, network, delegate (the tool packs' classes), write, payment (this
# policy's business tools), or an operator's own.

# Rule "unlisted tools": a tool no entry lists is refused where the tenant's (or route's) rule says so.
reasons contains msg if {
	some tool in input.request.tools
	not tool.known
	input.request.unlisted_tools.rule == "refuse"
	msg := sprintf("tool %s is not in the tool catalog, and %s refuses unlisted tools (rule: unlisted tools)", [tool.name, input.request.unlisted_tools.set_by])
}

# Rule "effect grants": every effect of every tool must be granted to the caller (its key's or JWT
# groups' grants, and its tenant's tool_effects).
reasons contains msg if {
	some tool in input.request.tools
	some effect in tool.effects
	not effect in input.identity.effects
	msg := sprintf("tool %s needs the %s effect, which the caller is not granted (rule: effect grants)", [tool.name, effect])
}

# Rule "effects by data class": what a data class may reach, whoever the caller. Confidential data is
# never given to a tool that runs commands, reaches the network or hands it to another agent;
# restricted data only to tools that read.
barred_effects := {
	"confidential": {"execute", "network", "delegate"},
	"restricted": {"edit", "execute", "network", "delegate", "write", "payment"},
}

reasons contains msg if {
	some tool in input.request.tools
	some effect in tool.effects
	effect in barred_effects[input.request.data_class]
	msg := sprintf("tool %s has the %s effect, which %s data may not reach (rule: effects by data class)", [tool.name, effect, input.request.data_class])
}

# Redact personal data and secrets from requests at or above the configured data class.
redact := data.gateway.redaction.entities if {
	data.gateway.redaction.from_data_class != null
	data.gateway.class_rank[input.request.data_class] >= data.gateway.class_rank[data.gateway.redaction.from_data_class]
} else := []

# Content may be recorded (after redaction) only for public data; the route must allow it too.
record_content if input.request.data_class == "public"

else := false

decision := {
	"allow": allow,
	"reasons": reasons,
	"obligations": {"redact": redact, "record_content": record_content},
}

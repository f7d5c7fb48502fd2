# Per-team tool grants: a tool may be offered to the model only by callers in a team (JWT group)
# granted that tool. Tools are named as in the request; their effects are checked by authz.rego.
package llmgw.examples.tool_grants

import rego.v1

grants := {
	"support": {"lookup_order", "update_ticket"},
	"finance": {"lookup_order", "issue_refund"},
}

granted contains tool if {
	some group in input.identity.groups
	some tool in grants[group]
}

reasons contains msg if {
	some tool in input.request.tools
	not tool.name in granted
	msg := sprintf("tool %s is not granted to any of the caller's teams", [tool.name])
}

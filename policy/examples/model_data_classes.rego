# A model allowed only for some data classes: the route names a model whose terms, or whose
# deployment, do not cover every class the gateway knows.
#
# Wire it into authz.rego with:  reasons contains msg if some msg in data.llmgw.examples.model_data_classes.reasons
package llmgw.examples.model_data_classes

import rego.v1

# Route -> the data classes it may carry. A route not listed here is not limited by this rule.
allowed_classes := {"chat-default": {"public", "internal", "confidential"}, "chat-experimental": {"public"}}

reasons contains msg if {
	some classes in [allowed_classes[input.request.route]]
	not input.request.data_class in classes
	msg := sprintf("route %s may not carry %s data", [input.request.route, input.request.data_class])
}

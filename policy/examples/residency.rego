# Residency by region: confidential and restricted data of some tenants must stay in the EU. The
# route must have a candidate for the class in an allowed region (ext_proc's router then keeps each
# request on candidates that qualify; this rule makes the refusal a 403 with a reason).
package llmgw.examples.residency

import rego.v1

eu_only := {"acme"}

eu := {"eu", "eu-west", "eu-central"}

sensitive := {"confidential", "restricted"}

reasons contains msg if {
	input.identity.tenant in eu_only
	input.request.data_class in sensitive
	not eu_candidate
	msg := sprintf("%s data of tenant %s must stay in the EU: no EU candidate serves it", [
		input.request.data_class, input.identity.tenant,
	])
}

eu_candidate if {
	some c in input.candidates
	input.request.data_class in c.data_classes
	some region in c.regions
	region in eu
}

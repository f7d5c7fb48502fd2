package llmgw.examples.residency_test

import rego.v1

import data.llmgw.examples.residency.reasons

request(tenant, class, regions) := {
	"identity": {"tenant": tenant},
	"request": {"data_class": class},
	"candidates": [{"deployment": "d", "data_classes": ["internal", "confidential"], "regions": regions}],
}

test_confidential_in_the_eu_is_allowed if {
	count(reasons) == 0 with input as request("acme", "confidential", ["eu-west"])
}

test_confidential_only_in_the_us_is_refused if {
	reasons == {"confidential data of tenant acme must stay in the EU: no EU candidate serves it"} with input as request("acme", "confidential", ["us-east"])
}

test_internal_data_may_leave if {
	count(reasons) == 0 with input as request("acme", "internal", ["us-east"])
}

test_other_tenants_are_not_bound if {
	count(reasons) == 0 with input as request("globex", "confidential", ["us-east"])
}

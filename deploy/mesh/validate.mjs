// Reads a JSON array of Kubernetes objects on stdin and validates each custom resource against its
// CRD's OpenAPI schema (the validators @kubernetes-models compiles from the CRDs). Prints one line per
// object; exits 1 if any is invalid, 2 if a kind has no validator here.
import { EnvoyFilter } from "@kubernetes-models/istio/networking.istio.io/v1alpha3/EnvoyFilter";
import { EnvoyPatchPolicy } from "@kubernetes-models/envoy-gateway/gateway.envoyproxy.io/v1alpha1/EnvoyPatchPolicy";
import { EnvoyProxy } from "@kubernetes-models/envoy-gateway/gateway.envoyproxy.io/v1alpha1/EnvoyProxy";

const MODELS = {
  "networking.istio.io/v1alpha3/EnvoyFilter": EnvoyFilter,
  "gateway.envoyproxy.io/v1alpha1/EnvoyPatchPolicy": EnvoyPatchPolicy,
  "gateway.envoyproxy.io/v1alpha1/EnvoyProxy": EnvoyProxy,
};

let input = "";
for await (const chunk of process.stdin) input += chunk;
let status = 0;
for (const doc of JSON.parse(input)) {
  const key = `${doc.apiVersion}/${doc.kind}`;
  const Model = MODELS[key];
  if (!Model) {
    console.log(`${key} ${doc.metadata?.name}: no validator`);
    status = Math.max(status, 2);
    continue;
  }
  try {
    new Model(doc).validate();
    console.log(`${key} ${doc.metadata?.name}: valid`);
  } catch (e) {
    console.log(`${key} ${doc.metadata?.name}: INVALID ${e.message}`);
    status = 1;
  }
}
process.exit(status);

"""Adapters: one module per upstream API shape, translating between the gateway's internal contract
(the OpenAI chat completion request, response and stream of extproc/chat.py) and that shape.

Plain values in, plain values out: no Envoy or gRPC types, so each translation is tested on its own
(the attempt filter and the decision call them). Every adapter offers the same five things:

- `request(body, target)`: the native request (path, headers, body) and the loss list
  (extproc/adapters/loss.py) - the fields it could not carry as they are;
- `response(status, body)`: a native JSON answer as the internal chat completion;
- `stream()`: an incremental translator fed the native stream's bytes, returning internal SSE events
  (`data: {chunk}`) - the rest of the gateway (stream guard, metering) sees one shape;
- `failure(status, body)`: a native error as the contract's code and the retry class it counts as;
- `usage(native)`: usage normalised to input, cached input, output and reasoning tokens.

An adapter is named in a deployment's fingerprint as `name@version` (`anthropic@1`); the version
changes when a translation changes, so evidence for the old one no longer qualifies the deployment.
The adapters by name, their options and their loss tables are found through the shapes registry
(extproc/shapes.py).
"""


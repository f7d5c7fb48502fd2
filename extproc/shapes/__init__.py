"""Provider API shapes, one folder each (anthropic/, bedrock/, gemini/, openai/): its adapter (the
request towards its upstreams, in Python in ext_proc), its front door where clients may speak it to
the gateway (door.py: the request into the internal contract at intake), and the tables the Lua
filters render in. The registry (registry.py) is the one list of them; base.py, loss.py, door.py and
door_stream.py are what every shape shares.

Plain values in, plain values out: no Envoy or gRPC types, so each translation is tested on its own
(the attempt filter and the decision call them). Every adapter offers the same things:

- `request(body, target)`: the native request (path, headers, body) and the loss list
  (extproc/shapes/loss.py) - the fields it could not carry as they are;
- `response(status, body)`, `stream()`, `failure(status, body)`, `usage(native)`: the answer, the
  stream, an error and the usage back in the internal shape. Envoy's Lua answer filter does this on
  every path (extproc/lua/answers.lua); these Python twins are the reference the tests hold it to.

An adapter is named in a deployment's fingerprint as `name@version` (`anthropic@1`); the version
changes when a translation changes, so evidence for the old one no longer qualifies the deployment.
The adapters by name, their options and their loss tables are found through the shapes registry
(extproc/shapes/registry.py).
"""


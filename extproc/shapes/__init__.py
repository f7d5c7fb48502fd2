"""Provider API shapes, one folder each (anthropic/, bedrock/, gemini/, openai/): its adapter (the
request towards its upstreams, in Python in ext_proc), its front door where clients may speak it to
the gateway (door.py: the request into the internal contract at intake), and the tables the Lua
filters render in, and its own Lua (answers.lua, door.lua: its answers, streams and errors back into
the internal shape and its door's callers' shape, which the renderer puts into Envoy's filters). The
registry (registry.py) is the one list of them; base.py, loss.py and door.py are what every shape
shares.

Plain values in, plain values out: no Envoy or gRPC types, so each translation is tested on its own
(the attempt filter and the decision call them). Every adapter offers `endpoint(target)` (the path and
headers of every request to a target) and `request(body, target)`: the native request (path,
headers, body) and the loss list (extproc/shapes/loss.py) - the fields it could not carry as they are.
The answer side (answers, streams, errors and usage back in the internal shape) runs in Envoy's Lua on
every path; its Python twin is the tests' oracle (tests/oracles/), no production path runs it.

An adapter is named in a deployment's fingerprint as `name@version` (`anthropic@1`); the version
changes when a translation changes, so evidence for the old one no longer qualifies the deployment.
The adapters by name, their options and their loss tables are found through the shapes registry
(extproc/shapes/registry.py).
"""


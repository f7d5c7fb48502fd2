"""A lone candidate of another API shape, translated without the attempt filter.

The attempt filter (extproc/service/attempts.py) costs four ext_proc messages per translated attempt: request
headers and body, response headers and body. When a request's plan is one candidate whose shape
Envoy's Lua answer filter can read (extproc/lua/answers.lua), and its answer is JSON that settles
through the access log or a stream the Lua stream guard settles, the decision translates the request
itself: the native body in its own reply, the path and the shape's headers (its key among them) as
metadata, which the Lua filter sets on the request after the header allow-list and then blanks. The
same filter translates the answer back before json_to_metadata reads its usage, or a stream chunk by
chunk before the Lua stream guard reads it. Such a request costs ext_proc no message more than one to
the pool, and a stream none per chunk. Plans of several candidates, idempotent answers, front doors
and shadowed requests keep the attempt filter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.config.schema import Deployment
from extproc.contract import ErrorCode, GatewayError
from extproc.shapes.base import Target
from extproc.shapes.registry import adapter_for


def _target(dep: Deployment, credentials: Mapping[str, str], credential_errors: Mapping[str, str],
            stream: bool = False) -> Target:
    """What `dep`'s adapter translates for, its credential resolved when the revision loaded; refused
    (503 `policy_unavailable`) when the deployment's credential reference did not resolve."""
    token = ""
    if dep.credential_ref:
        if dep.deployment not in credentials:
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, credential_errors.get(
                dep.deployment, f"credential reference {dep.credential_ref} is not resolved"))
        token = credentials[dep.deployment]
    return Target(dep.served_model, token, dep.fingerprint.adapter_options, stream)


def native_request(dep: Deployment, body: Mapping[str, Any], credentials: Mapping[str, str],
                   credential_errors: Mapping[str, str], stream: bool = False) -> tuple[bytes, dict[str, str], str]:
    """The request as `dep`'s provider takes it: its body, its headers (`:path` among them, and the
    credential), and the shape of its answer."""
    adapter = adapter_for(dep.fingerprint.adapter)
    native = adapter.request(body, _target(dep, credentials, credential_errors, stream))
    return native.body, {":path": native.path, **native.headers, **native.signed_headers}, adapter.name


def count_request(dep: Deployment, body: Mapping[str, Any], credentials: Mapping[str, str],
                  credential_errors: Mapping[str, str]) -> tuple[bytes, dict[str, str], str]:
    """The request that counts the prompt's tokens as `dep` would: its body, its headers (`:path`
    among them), and the shape of its answer (the field its count is in)."""
    adapter = adapter_for(dep.fingerprint.adapter)
    native = adapter.count_request(body, _target(dep, credentials, credential_errors))
    return native.body, {":path": native.path, **native.headers, **native.signed_headers}, adapter.name

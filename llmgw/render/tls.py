"""TLS in the rendered bootstrap: the listener's certificate (and client CA) and Envoy -> ext_proc mTLS."""

from __future__ import annotations

from pathlib import Path

from envoy.config.core.v3 import base_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2 as tls_common_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
from envoy.type.matcher.v3 import string_pb2
from google.protobuf import wrappers_pb2

from extproc.config.schema import ExtprocTls, ListenerTls, TlsSettings
from llmgw.render.common import pack


def absolute_tls(tls: TlsSettings, base: Path) -> TlsSettings:
    """gateway.yaml's certificate paths are relative to the policy directory; Envoy needs them whole."""
    def fix(model: ListenerTls | ExtprocTls | None) -> dict[str, object] | None:
        if model is None:
            return None
        return {k: (str(base / v) if k.endswith("_file") and isinstance(v, str) else v)
                for k, v in model.model_dump().items()}
    return TlsSettings.model_validate({"listener": fix(tls.listener), "extproc": fix(tls.extproc)})


def _file(path: str) -> base_pb2.DataSource:
    return base_pb2.DataSource(filename=path)  # Envoy reads the file; the config never holds a key


def listener_tls(tls: ListenerTls) -> base_pb2.TransportSocket:
    common = tls_pb2.CommonTlsContext(
        tls_certificates=[tls_common_pb2.TlsCertificate(certificate_chain=_file(tls.cert_file),
                                                        private_key=_file(tls.key_file))],
        alpn_protocols=["h2", "http/1.1"])
    if tls.client_ca_file:
        common.validation_context.trusted_ca.CopyFrom(_file(tls.client_ca_file))
    ctx = tls_pb2.DownstreamTlsContext(
        common_tls_context=common,
        require_client_certificate=wrappers_pb2.BoolValue(value=tls.require_client_certificate))
    return base_pb2.TransportSocket(name="envoy.transport_sockets.tls", typed_config=pack(ctx))


def upstream_tls(server_name: str, ca_file: str) -> base_pb2.TransportSocket:
    """Envoy -> a hosted provider: SNI `server_name`, and only a certificate for that name from a CA
    in `ca_file` (Envoy checks neither unless told)."""
    common = tls_pb2.CommonTlsContext(
        validation_context=tls_common_pb2.CertificateValidationContext(
            trusted_ca=_file(ca_file),
            match_typed_subject_alt_names=[tls_common_pb2.SubjectAltNameMatcher(
                san_type=tls_common_pb2.SubjectAltNameMatcher.DNS,
                matcher=string_pb2.StringMatcher(exact=server_name))]),
        alpn_protocols=["http/1.1"])
    ctx = tls_pb2.UpstreamTlsContext(common_tls_context=common, sni=server_name)
    return base_pb2.TransportSocket(name="envoy.transport_sockets.tls", typed_config=pack(ctx))


def loopback_tls() -> base_pb2.TransportSocket:
    """Envoy -> its own TLS listener on loopback (shadow copies): the peer is this process, so there is
    no certificate to check that the connection's address does not already prove."""
    ctx = tls_pb2.UpstreamTlsContext(common_tls_context=tls_pb2.CommonTlsContext(alpn_protocols=["http/1.1"]))
    return base_pb2.TransportSocket(name="envoy.transport_sockets.tls", typed_config=pack(ctx))


def extproc_mtls(tls: ExtprocTls) -> base_pb2.TransportSocket:
    """Envoy -> ext_proc: verify ext_proc's certificate against the CA and present Envoy's own."""
    common = tls_pb2.CommonTlsContext(
        tls_certificates=[tls_common_pb2.TlsCertificate(certificate_chain=_file(tls.client_cert_file),
                                                        private_key=_file(tls.client_key_file))],
        validation_context=tls_common_pb2.CertificateValidationContext(
            trusted_ca=_file(tls.ca_file),
            match_typed_subject_alt_names=[tls_common_pb2.SubjectAltNameMatcher(
                san_type=tls_common_pb2.SubjectAltNameMatcher.DNS,
                matcher=string_pb2.StringMatcher(exact=tls.server_name))]),
        alpn_protocols=["h2"])
    ctx = tls_pb2.UpstreamTlsContext(common_tls_context=common, sni=tls.server_name)
    return base_pb2.TransportSocket(name="envoy.transport_sockets.tls", typed_config=pack(ctx))

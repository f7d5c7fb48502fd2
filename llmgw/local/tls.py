"""Demo certificates for `llmgw up --tls`, made locally with `cryptography`: one CA signs the
gateway's server certificate, ext_proc's server certificate, Envoy's client certificate for ext_proc
(mTLS) and a client certificate for callers when client certificates are required. Production
deployments point gateway.yaml's `tls` at their own files instead."""

from __future__ import annotations

import ipaddress
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from extproc.config.schema import ExtprocTls, ListenerTls, TlsSettings

EXTPROC_NAME = "extproc.llmgw.internal"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmgw demo"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(directory: Path, stem: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    (directory / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path = directory / f"{stem}.key"
    path.touch(mode=0o600)
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def _issue(ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate, cn: str, server: bool,
           sans: list[x509.GeneralName]) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=30))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(
                   [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def server_cert(directory: Path, name: str) -> tuple[Path, Path, Path]:
    """A certificate for `name` from the demo CA in `directory` (made when missing): (CA, certificate,
    key) files - for a simulated provider served over TLS, as a real one is."""
    demo_certs(directory)
    ca_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    stem = "server-" + name.replace("*", "_")
    _write(directory, stem, *_issue(ca_key, ca, name, True, [x509.DNSName(name)]))
    return directory / "ca.crt", directory / f"{stem}.crt", directory / f"{stem}.key"


def demo_certs(directory: Path, require_client_certificate: bool = False) -> TlsSettings:
    """Make (or reuse) the demo CA and certificates in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "ca.crt").exists():
        ca_key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.now(UTC)
        ca = (x509.CertificateBuilder().subject_name(_name("llmgw demo CA")).issuer_name(_name("llmgw demo CA"))
              .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=30))
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                           content_commitment=False, key_encipherment=False,
                                           data_encipherment=False, key_agreement=False, encipher_only=False,
                                           decipher_only=False), critical=True)
              .sign(ca_key, hashes.SHA256()))
        _write(directory, "ca", ca_key, ca)
        loopback = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        _write(directory, "gateway", *_issue(ca_key, ca, "localhost", True, loopback))
        _write(directory, "extproc", *_issue(ca_key, ca, EXTPROC_NAME, True, [x509.DNSName(EXTPROC_NAME)]))
        _write(directory, "envoy-client", *_issue(ca_key, ca, "envoy", False, []))
        _write(directory, "client", *_issue(ca_key, ca, "demo client", False, []))
    d = directory.resolve()
    return TlsSettings(
        listener=ListenerTls(cert_file=str(d / "gateway.crt"), key_file=str(d / "gateway.key"),
                             client_ca_file=str(d / "ca.crt"), require_client_certificate=require_client_certificate),
        extproc=ExtprocTls(ca_file=str(d / "ca.crt"), server_cert_file=str(d / "extproc.crt"),
                           server_key_file=str(d / "extproc.key"), client_cert_file=str(d / "envoy-client.crt"),
                           client_key_file=str(d / "envoy-client.key"), server_name=EXTPROC_NAME),
    )

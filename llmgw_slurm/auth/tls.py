"""Mutual TLS between the gateway and its engines: who may talk to whom.

A shared cluster's users can listen on any free port of a node and connect to
any port. An engine's API key guards only some of its paths (vLLM: ``/v1``),
and a key sent to whoever answers on the engine's port is a key given away.
So both ends of the gateway-engine connection prove who they are with a
certificate, before a byte of a request (or its key) is sent:

- **The engine** serves TLS with a key pair its agent makes when the job
  starts (a self-signed certificate, a private key in a directory only the
  job's user can read). The agent reports the certificate in its signed
  report, and the gateway trusts that one certificate, and nothing else, for
  that replica: a listener that took the engine's port has no such key and
  fails the handshake.
- **The gateway** presents a client certificate of its own (its key lives in
  the daemon's private state directory); the job receives the certificate,
  never the key, and the engine refuses every connection without it, whatever
  the path. The agent adds its own certificate to what the engine accepts, to
  poll readiness and load.

Certificates are pinned, not checked against names: a replica's address is
what Slurm gave it, and the only certificate that can pass is the one its
agent signed for. Both are EC P-256, made by ``cryptography``.
"""

from __future__ import annotations

import datetime
import hashlib
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw_slurm.base.fsutil import atomic_write

__all__ = [
    "CERT_MAX_BYTES",
    "EngineTLS",
    "Identity",
    "PEMError",
    "PinnedContexts",
    "check_certificate",
    "client_context",
    "engine_address_problem",
    "fingerprint",
    "load_or_create_identity",
    "make_engine_tls",
    "make_identity",
]

# A P-256 certificate is about 600 bytes; this bounds what a report may carry.
CERT_MAX_BYTES = 8192
# The gateway's certificate outlives any replica; a replica's outlives its job
# (Slurm's longest time limits are weeks). Neither is checked against a CA's
# revocation: a replica's pin is dropped when the replica goes, and the
# gateway's key is replaced by deleting it from the state directory.
_GATEWAY_DAYS = 3650
_ENGINE_DAYS = 400


class PEMError(ValueError):
    """Not one well-formed PEM certificate."""


@dataclass(frozen=True)
class Identity:
    """A certificate (PEM text) and the path of the files holding it and its key."""

    cert_pem: str
    cert_file: Path
    key_file: Path


@dataclass(frozen=True)
class EngineTLS:
    """What an engine is started with: its key pair and whom it accepts.

    ``ca_file`` holds the gateway's certificate and the agent's own, the only
    two clients the engine lets in.
    """

    identity: Identity
    ca_file: Path
    directory: Path

    def agent_context(self) -> ssl.SSLContext:
        """The agent's client side: its own certificate, trusting only its engine's."""
        return client_context(
            self.identity.cert_pem, self.identity.cert_file, self.identity.key_file
        )


def _certificate(common_name: str, key: ec.EllipticCurvePrivateKey, days: int) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        # Clocks of a cluster's nodes differ by seconds, sometimes more.
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )


def make_identity(directory: Path, name: str, common_name: str, days: int) -> Identity:
    """A fresh key pair in ``directory`` as NAME.key and NAME.crt (both 0600)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(common_name, key, days)
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    key_file, cert_file = directory / f"{name}.key", directory / f"{name}.crt"
    # The key first: a certificate without its key would be read as complete.
    atomic_write(key_file, key_pem, mode=0o600)
    atomic_write(cert_file, cert_pem, mode=0o600)
    return Identity(cert_pem.decode(), cert_file, key_file)


def load_or_create_identity(state_dir: Path) -> Identity:
    """The gateway's client identity, made on first start in the state directory.

    Replicas started by an earlier run of the daemon accept only this
    certificate, so it is kept across restarts like the server key.
    """
    key_file, cert_file = state_dir / "gateway-client.key", state_dir / "gateway-client.crt"
    try:
        cert_pem = cert_file.read_text()
        check_certificate(cert_pem)
        if key_file.is_file():
            return Identity(cert_pem, cert_file, key_file)
    except (FileNotFoundError, PEMError, UnicodeDecodeError):
        pass
    state_dir.mkdir(parents=True, exist_ok=True)
    return make_identity(state_dir, "gateway-client", "llmgw-slurm gateway", _GATEWAY_DAYS)


def check_certificate(pem: str) -> x509.Certificate:
    """The one certificate ``pem`` holds; PEMError saying what is wrong otherwise."""
    if len(pem) > CERT_MAX_BYTES:
        raise PEMError(f"certificate of {len(pem)} bytes (at most {CERT_MAX_BYTES})")
    if pem.count("-----BEGIN CERTIFICATE-----") != 1:
        raise PEMError("expected exactly one PEM certificate")
    try:
        return x509.load_pem_x509_certificate(pem.encode())
    except ValueError as err:
        raise PEMError(f"not a certificate: {err}") from err


def fingerprint(pem: str) -> str:
    """SHA-256 of the certificate's DER form, as hex (what logs and status show)."""
    der = check_certificate(pem).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).hexdigest()


def client_context(pinned_pem: str, cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """A client context that trusts exactly ``pinned_pem`` and presents ``cert_file``.

    No name check: the pin is the whole check (see the module docstring).
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=pinned_pem)
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


def make_engine_tls(
    gateway_cert_pem: str, replica_id: str, parent: Path | None = None
) -> EngineTLS:
    """The engine's key pair and trust file, in a new directory only this user can read.

    ``mkdtemp`` makes the directory 0700; the engine (and an Apptainer image,
    through a bind) reads the files from there.
    """
    check_certificate(gateway_cert_pem)
    directory = Path(tempfile.mkdtemp(prefix=f"llmgw-tls-{replica_id}-", dir=parent))
    ident = make_identity(directory, "engine", f"llmgw-slurm replica {replica_id}", _ENGINE_DAYS)
    ca_file = directory / "clients.pem"
    atomic_write(ca_file, (gateway_cert_pem.strip() + "\n" + ident.cert_pem).encode(), mode=0o600)
    return EngineTLS(identity=ident, ca_file=ca_file, directory=directory)


class PinnedContexts:
    """The gateway's client contexts, one per engine certificate it pins.

    Building a context parses the certificate and the gateway's key (about a
    millisecond): done once per replica, not per request. Contexts of replicas
    that are gone are dropped oldest first past ``limit``.
    """

    def __init__(self, identity: Identity, limit: int = 4096) -> None:
        self.identity = identity
        self._limit = limit
        self._contexts: dict[str, ssl.SSLContext] = {}

    def get(self, cert_pem: str) -> ssl.SSLContext:
        ctx = self._contexts.get(cert_pem)
        if ctx is None:
            ctx = client_context(cert_pem, self.identity.cert_file, self.identity.key_file)
            if len(self._contexts) >= self._limit:
                del self._contexts[next(iter(self._contexts))]
            self._contexts[cert_pem] = ctx
        return ctx


def engine_address_problem(url: str, cert: object, tls_required: bool) -> str:
    """Why a reported engine address may not be used; "" when it may.

    An https engine comes with the certificate to pin; a plain-http one only
    where the model's catalog entry turned TLS off (``engine.tls: false``).
    """
    if url.startswith("https://"):
        if not isinstance(cert, str) or not cert:
            return "an https engine reported without its certificate"
        try:
            check_certificate(cert)
        except PEMError as err:
            return f"the engine's certificate: {err}"
        return ""
    if not url.startswith("http://"):
        return f"{url[:100]!r} is not an http(s) URL"
    if tls_required:
        return "a plain-http engine for a model whose engine serves TLS (engine.tls)"
    return ""

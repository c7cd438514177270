"""Archive signatures: ed25519 over the manifest's exact bytes.

The manifest pins every blob by sha256 (and the graph table, kernel images, allocation log and RNG
state are blobs), so one signature over its bytes covers the whole archive. SAVE signs with a PEM
ed25519 private key (`EMBER_SIGNING_KEY`, a file path) and stores the signature beside the manifest
(`archives/<hash>/manifest.sig`, written BEFORE the manifest, which still goes last). Readers that
are given trusted public keys (`EMBER_TRUSTED_KEYS`, several during a key rotation) verify the
signature over the manifest bytes before parsing the manifest or using any blob; an unsigned or
wrongly signed archive is refused with `SignatureError`. With no trusted keys nothing is checked.

The signature file is JSON::

    {"kind": "ember.dev/manifest-signature", "algorithm": "ed25519",
     "keyId": "ed25519:<16 hex>", "signature": "<base64 of 64 bytes>"}

`keyId` is the key's fingerprint (sha256 of the raw 32-byte public key), computed from the key,
never taken on trust: a trusted key's `id` in a ModelDeployment is only a name for people.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ember import contract

SIGNATURE_KIND = "ember.dev/manifest-signature"
ALGORITHM = "ed25519"
UNSIGNED = "unsigned"


class SignatureError(ValueError):
    """The archive's signature is missing, malformed, by an untrusted key, or does not match."""


class SigningKeyError(ValueError):
    """A signing or trusted key cannot be read (names which and why)."""


@dataclass(frozen=True)
class TrustedKey:
    """A public key a deployment trusts; `name` is the id it was given (or the fingerprint)."""

    public: Ed25519PublicKey
    name: str = ""

    @property
    def key_id(self) -> str:
        return key_id(self.public)

    def label(self) -> str:
        return f"{self.name} ({self.key_id})" if self.name and self.name != self.key_id else self.key_id


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return f"{ALGORITHM}:{hashlib.sha256(raw).hexdigest()[:16]}"


# ---- keys ----------------------------------------------------------------------------------------


def load_private_key(pem: bytes | str | os.PathLike[str]) -> Ed25519PrivateKey:
    """A PEM (PKCS#8) ed25519 private key: its bytes, or a file path."""
    data = pem if isinstance(pem, bytes) else Path(pem).read_bytes()
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(f"signing key is not an unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(f"signing key is a {type(key).__name__}, not ed25519")
    return key


def signing_key_from_env(environ: dict[str, str] | None = None) -> Ed25519PrivateKey | None:
    """The SAVE's signing key from ENV_SIGNING_KEY (a path); None when unset. An unreadable key
    raises: a SAVE told to sign must not publish an unsigned archive."""
    path = (os.environ if environ is None else environ).get(contract.ENV_SIGNING_KEY, "").strip()
    if not path:
        return None
    try:
        return load_private_key(path)
    except OSError as exc:
        raise SigningKeyError(f"{contract.ENV_SIGNING_KEY}={path}: {exc}") from exc


def parse_public_key(text: str) -> Ed25519PublicKey:
    """A PEM public key, or base64 of the raw 32 bytes or of the DER SubjectPublicKeyInfo."""
    text = text.strip()
    try:
        if text.startswith("-----BEGIN"):
            key = serialization.load_pem_public_key(text.encode())
        else:
            raw = base64.b64decode(text, validate=True)
            key = (Ed25519PublicKey.from_public_bytes(raw) if len(raw) == 32
                   else serialization.load_der_public_key(raw))
    except (ValueError, TypeError, binascii.Error) as exc:
        raise SigningKeyError(f"trusted key is not a PEM or base64 ed25519 public key ({exc})") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise SigningKeyError(f"trusted key is a {type(key).__name__}, not ed25519")
    return key


def public_key_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """Base64 of the raw public key: the form a ModelDeployment's trustedKeys takes."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return base64.b64encode(public.public_bytes(serialization.Encoding.Raw,
                                                serialization.PublicFormat.Raw)).decode()


def private_key_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def trusted_keys_json(keys: Sequence[tuple[str, str]]) -> str:
    """ENV_TRUSTED_KEYS's value for (id, public key text) pairs."""
    return json.dumps([{"id": name, "publicKey": text} for name, text in keys], sort_keys=True)


def parse_trusted_keys(raw: str | None) -> list[TrustedKey]:
    """ENV_TRUSTED_KEYS's value: a JSON list of {"id", "publicKey"} objects or of key strings.
    Empty → []. An entry that is not a key raises SigningKeyError (a trust list that cannot be read
    must not quietly turn verification off)."""
    raw = (raw or "").strip()
    if not raw:
        return []
    try:
        items = json.loads(raw)
    except ValueError as exc:
        raise SigningKeyError(f"{contract.ENV_TRUSTED_KEYS} is not JSON ({exc})") from exc
    if not isinstance(items, list):
        raise SigningKeyError(f"{contract.ENV_TRUSTED_KEYS} is not a JSON list")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(TrustedKey(parse_public_key(item)))
        elif isinstance(item, dict) and isinstance(item.get("publicKey"), str):
            out.append(TrustedKey(parse_public_key(item["publicKey"]), str(item.get("id") or "")))
        else:
            raise SigningKeyError(f"{contract.ENV_TRUSTED_KEYS}: entry {item!r} is not a key")
    return out


def trusted_keys_from_env(environ: dict[str, str] | None = None) -> list[TrustedKey]:
    return parse_trusted_keys((os.environ if environ is None else environ).get(contract.ENV_TRUSTED_KEYS))


# ---- sign and verify -----------------------------------------------------------------------------


def sign(manifest: bytes, key: Ed25519PrivateKey) -> bytes:
    """The signature file for these exact manifest bytes."""
    doc = {"kind": SIGNATURE_KIND, "algorithm": ALGORITHM, "keyId": key_id(key.public_key()),
           "signature": base64.b64encode(key.sign(manifest)).decode()}
    return (json.dumps(doc, sort_keys=True, indent=1) + "\n").encode()


def read_signature(signature: bytes) -> tuple[str, bytes]:
    """(key id, raw signature) of a signature file; SignatureError when it is not one."""
    try:
        doc = json.loads(signature)
        if not isinstance(doc, dict) or doc.get("kind") != SIGNATURE_KIND:
            raise SignatureError("signature file is not an ember manifest signature")
        if doc.get("algorithm") != ALGORITHM:
            raise SignatureError(f"signature algorithm {doc.get('algorithm')!r} is not {ALGORITHM}")
        raw = base64.b64decode(str(doc["signature"]), validate=True)
        return str(doc["keyId"]), raw
    except SignatureError:
        raise
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise SignatureError(f"signature file is malformed ({exc})") from exc


def verify(manifest: bytes, signature: bytes | None, trusted: Sequence[TrustedKey]) -> TrustedKey:
    """The trusted key that signed these manifest bytes; SignatureError says why none did."""
    if not trusted:
        raise SignatureError("no trusted keys to verify against")
    if signature is None:
        raise SignatureError("archive is unsigned (no manifest.sig) and this deployment trusts only "
                             f"signed archives (keys {', '.join(k.label() for k in trusted)})")
    kid, raw = read_signature(signature)
    match = [k for k in trusted if k.key_id == kid]
    if not match:
        raise SignatureError(f"archive is signed by key {kid}, which this deployment does not trust "
                             f"(trusted: {', '.join(k.label() for k in trusted)})")
    try:
        match[0].public.verify(raw, manifest)
    except InvalidSignature:
        raise SignatureError(f"signature by {match[0].label()} does not match the manifest: "
                             "the manifest or its signature was altered") from None
    return match[0]


def describe(manifest: bytes, signature: bytes | None, trusted: Sequence[TrustedKey]) -> tuple[bool, str]:
    """(ok, one line) for `ember verify`: "unsigned", "signed by X (not checked: ...)", "signed by X,
    verified", or why verification failed. ok is False only for a failed check."""
    if not trusted:
        if signature is None:
            return True, UNSIGNED
        try:
            kid, _ = read_signature(signature)
        except SignatureError as exc:
            return True, f"signature unreadable ({exc}); not checked: no trusted key given"
        return True, f"signed by {kid} (not checked: no trusted key given)"
    try:
        key = verify(manifest, signature, trusted)
    except SignatureError as exc:
        return False, str(exc)
    return True, f"signed by {key.label()}, verified"

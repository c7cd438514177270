"""`spec.archive` of a ModelDeployment: how its archives are signed and which keys its pods trust
(re-exported by ember_operator/api.py; the crypto is ember/archive/signing.py)."""

from __future__ import annotations

from pydantic import Field, field_validator

from ember.archive import signing
from ember_operator.api_base import DNS1123_SUBDOMAIN, ApiModel

# What parse_public_key takes: base64 of the raw 32 bytes (44 characters), of the 44-byte DER
# SubjectPublicKeyInfo (60 characters), or a PEM public key. Admission checks the form; the
# operator parses the key itself (InvalidSpec) before any pod is told to trust it.
PUBLIC_KEY = (r"^([A-Za-z0-9+/]{43}=|[A-Za-z0-9+/]{60}"
              r"|-----BEGIN PUBLIC KEY-----[A-Za-z0-9+/=\s]+-----END PUBLIC KEY-----\s*)$")


class TrustedKey(ApiModel):
    """An ed25519 public key archives may be signed with."""

    id: str = Field(min_length=1, max_length=63, description="A name for the key (e.g. 2026-q4); "
                    "signatures name keys by fingerprint, so this is for people.")
    public_key: str = Field(min_length=40, max_length=1024, pattern=PUBLIC_KEY,
                            description="ed25519 public key: base64 of the raw 32 bytes (44 characters), "
                            "base64 of its DER SubjectPublicKeyInfo, or PEM.")

    @field_validator("public_key")
    @classmethod
    def _parses(cls, value: str) -> str:
        try:
            signing.parse_public_key(value)
        except signing.SigningKeyError as exc:
            raise ValueError(f"archive.signing.trustedKeys: {exc}") from exc
        return value


class SigningSpec(ApiModel):
    """Archive signatures (ed25519 over the manifest, which pins every blob's sha256)."""

    secret_name: str | None = Field(
        None, max_length=253, pattern=DNS1123_SUBDOMAIN,
        description="Secret (this namespace) holding the SAVE's PEM ed25519 private key under the key "
        "'signing-key.pem', mounted into the SAVE Job; the operator's default (setting "
        "signing_secret) when unset; archives are unsigned when neither is set.",
    )
    trusted_keys: list[TrustedKey] = Field(
        default_factory=list, max_length=8,
        description="Public keys this deployment trusts (several during a key rotation). Set: the "
        "sidecar and LOAD refuse an archive not signed by one of them (native capture, Warning "
        "event). Empty: signatures are not checked.",
    )


class ArchiveSettings(ApiModel):
    """How the deployment's archives are made and trusted."""

    signing: SigningSpec = Field(default_factory=SigningSpec, description="Archive signatures.")

"""Claim and prefetch annotation parsing, and fallback reason classes (pure)."""

from __future__ import annotations

import pytest

from ember.contract import ANN_ARCHIVE, ANN_IDENTITY, ANN_NATIVE_REASON, ClaimError, parse_claimed_at
from ember_sidecar.claims import parse_claim, parse_prefetch, reason_class

H = "ab" * 32
URI = f"s3://bucket/prefix/archives/{H}/manifest"
D = "0f" * 32  # the manifest digest pinned by the claim
PIN = {"ember.dev/manifest-digest": D}


def test_unclaimed_pod_has_no_claim() -> None:
    assert parse_claim({}) is None
    assert parse_claim(None) is None
    assert parse_claim({"ember.dev/pool": "warm"}) is None


def test_full_claim() -> None:
    c = parse_claim({"ember.dev/archive": URI, "ember.dev/identity": H, "ember.dev/rank": "1",
                     "ember.dev/world": "4", "ember.dev/claimed-at": "1700000000.5", **PIN})
    assert c is not None
    assert (c.archive_uri, c.identity, c.rank, c.world, c.claimed_at) == (URI, H, 1, 4, 1700000000.5)
    assert c.manifest_digest == D
    assert c.key == parse_claim({"ember.dev/archive": URI, "ember.dev/identity": H,
                                 "ember.dev/rank": "1", "ember.dev/world": "4", **PIN}).key


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        ({"ember.dev/identity": H}, "no ember.dev/archive"),
        ({"ember.dev/archive": URI}, "no ember.dev/identity"),
        ({"ember.dev/archive": URI, "ember.dev/identity": "XYZ"}, "not an identity hash"),
        ({"ember.dev/archive": "s3://b/whatever", "ember.dev/identity": H}, "not a manifest URI"),
        ({"ember.dev/archive": URI, "ember.dev/identity": "cd" * 32}, "identity-mismatch"),
        ({"ember.dev/archive": URI, "ember.dev/identity": H, "ember.dev/rank": "x"}, "not an integer"),
        ({"ember.dev/archive": URI, "ember.dev/identity": H, "ember.dev/rank": "2",
          "ember.dev/world": "2", **PIN}, "not a valid rank layout"),
        ({"ember.dev/archive": URI, "ember.dev/identity": H}, "no ember.dev/manifest-digest"),
        ({"ember.dev/archive": URI, "ember.dev/identity": H, "ember.dev/manifest-digest": "abc"},
         "not a sha256"),
    ],
)
def test_bad_claims_raise_with_reason(annotations: dict[str, str], message: str) -> None:
    with pytest.raises(ClaimError, match=message):
        parse_claim(annotations)


def test_bad_claimed_at_is_ignored() -> None:
    c = parse_claim({"ember.dev/archive": URI, "ember.dev/identity": H, "ember.dev/claimed-at": "soon",
                     **PIN})
    assert c is not None and c.claimed_at is None


def test_prefetch_lists() -> None:
    other = f"file:///x/archives/{'cd' * 32}/manifest"
    assert parse_prefetch({"ember.dev/prefetch": f"{URI}, {other}\n{URI}"}) == [URI, other]
    assert parse_prefetch({"ember.dev/prefetch": f'["{URI}", 3, "junk"]'}) == [URI]
    assert parse_prefetch({"ember.dev/prefetch": "[broken"}) == []
    assert parse_prefetch({}) == []


def test_reason_class_is_bounded() -> None:
    assert reason_class("digest-mismatch: blob 1234 is corrupt") == "digest-mismatch"
    assert reason_class("store-unavailable: cannot reach http://x") == "store-unavailable"
    assert reason_class("Weird Thing!!") == "weird-thing"
    assert reason_class("") == "unknown"
    assert len(reason_class("x" * 500)) <= 48


def test_claimed_at_formats() -> None:
    assert parse_claimed_at("1700000000.25") == 1700000000.25
    assert parse_claimed_at("2023-11-14T22:13:20.5Z") == 1700000000.5
    assert parse_claimed_at("2023-11-14T22:13:20Z") is None  # whole seconds: too coarse to time
    assert parse_claimed_at("soon") is None and parse_claimed_at(None) is None


def test_claim_without_archive_carries_the_operators_native_reason() -> None:
    annotations = {ANN_IDENTITY: "ab" * 32, ANN_ARCHIVE: "",
                   ANN_NATIVE_REASON: "archive not ready: SaveFailed"}
    with pytest.raises(ClaimError, match="native capture chosen by the operator: archive not ready"):
        parse_claim(annotations)
    del annotations[ANN_NATIVE_REASON]
    with pytest.raises(ClaimError, match="but no"):
        parse_claim(annotations)

# ruff: noqa: E501  (embedded Python snippets read better unwrapped)
"""libember's kernel-image reader (ember_read_images, native/src/blob_reader.cpp) against the
stand-in driver: blobs read as far as they are allowed, verified (size, both sha256, the content
hash), decompressed, preloaded in the archive's order; a damaged or missing blob stops the
readers and names itself; close() leaves no reader behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

HELPERS = """
import hashlib, threading, zstandard
from ember.native import BlobRead
D = os.environ["TEST_DIR"]
def ptx(k):  # distinct images (content hashes), one kernel each
    return f"//\\n.version 8.0\\n.target sm_90\\n.entry k{k}(\\n)\\n{{ ret; }}\\n\\0".encode()
def blob(i, raw, codec, damage=None):
    stored = zstandard.ZstdCompressor().compress(raw) if codec else raw
    sha = hashlib.sha256(stored).hexdigest()
    path = os.path.join(D, sha)
    with open(path, "wb") as f:
        f.write(damage(stored) if damage else stored)
    return BlobRead(name=f"kernel_images/{i}".encode(), hash=ip.hash(raw).encode(), path=path.encode(),
                    sha256=sha.encode(), raw_sha256=hashlib.sha256(raw).hexdigest().encode(),
                    stored_size=len(stored), raw_size=len(raw), options_json=None, codec=codec)
def preloaded():
    return [im["hash"] for im in ip.catalog() if im["api"] == "preload"]
def readers():
    return sorted(t.name for t in threading.enumerate())
"""


def _last_json(out) -> dict:
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_reads_as_far_as_allowed_and_preloads_in_order(run_py, tmp_path: Path) -> None:
    out = run_py(
        HELPERS + """
images = [ptx(k) for k in range(8)]
blobs = [blob(i, im, i % 2) for i, im in enumerate(images)]   # zstd and stored raw, alternating
reads = ip.read_images(blobs, 3)
nothing = reads.wait(1, 0.2)           # nothing allowed yet
reads.allow(3)
three = reads.wait(3, 10.0)
still = reads.wait(4, 0.2)             # three allowed: it stops there
first = preloaded()
reads.allow(8)
every = reads.wait(8, 10.0)
reads.close()
fns = [ip.function(ip.hash(im), f"k{k}") for k, im in enumerate(images)]
print(json.dumps({"nothing": nothing, "three": three, "still": still, "first": first, "every": every,
                  "order": preloaded(), "hashes": [ip.hash(im) for im in images], "fns": fns}))
""",
        mode="load",
        env={"TEST_DIR": str(tmp_path)},
    )
    r = _last_json(out)
    assert (r["nothing"], r["three"], r["still"], r["every"]) == (0, 3, 3, 8)
    assert r["first"] == r["hashes"][:3]
    assert r["order"] == r["hashes"]  # the loaders' queue keeps the archive's order
    assert all(r["fns"])


DAMAGES = {
    "flipped": ("lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:]", "stored bytes do not match their digest"),
    "truncated": ("lambda b: b[:-5]", "bytes, the manifest says"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_blob_stops_the_readers_and_names_itself(run_py, tmp_path: Path, damage: str) -> None:
    fn, message = DAMAGES[damage]
    out = run_py(
        HELPERS + f"""
images = [ptx(k) for k in range(12)]
blobs = [blob(i, im, 1, damage=({fn}) if i == 4 else None) for i, im in enumerate(images)]
reads = ip.read_images(blobs, 2)
reads.allow(12)
try:
    reads.wait(12, 10.0); err = None
except EmberError as exc:
    err = (exc.code, str(exc))
try:
    again = reads.wait(12, 0.1); err2 = None
except EmberError as exc:
    err2 = exc.code
reads.close()
print(json.dumps({{"err": err, "err2": err2, "order": preloaded(), "hashes": [ip.hash(im) for im in images],
                   "threads": readers()}}))
""",
        mode="load",
        env={"TEST_DIR": str(tmp_path)},
    )
    r = _last_json(out)
    code, msg = r["err"]
    assert code == -10 and "blob 'kernel_images/4'" in msg and message in msg, msg
    assert r["err2"] == -10  # every later wait says so too
    # what came before it may be preloaded, in order; nothing from the damaged one on
    assert r["order"] == r["hashes"][: len(r["order"])] and len(r["order"]) <= 4
    assert r["threads"] == ["MainThread"]


def test_wrong_raw_digest_missing_file_and_content_hash(run_py, tmp_path: Path) -> None:
    out = run_py(
        HELPERS + """
def first_error(blobs):
    reads = ip.read_images(blobs, 2)
    reads.allow(len(blobs))
    try:
        reads.wait(len(blobs), 10.0)
        return None
    except EmberError as exc:
        return [exc.code, str(exc)]
    finally:
        reads.close()
a, b = blob(0, ptx(0), 1), blob(1, ptx(1), 1)
a.raw_sha256 = b"0" * 64                  # decompresses, but not to what the manifest says
raw_digest = first_error([a])
gone = blob(2, ptx(2), 0)
os.unlink(gone.path)
missing = first_error([gone])
b.hash = ip.hash(ptx(7)).encode()         # verified bytes, named under another image
content = first_error([b])
try:
    ip.read_images([BlobRead(name=b"x", hash=b"y", path=b"z", sha256=b"s", raw_sha256=None,
                             stored_size=1, raw_size=0, options_json=None, codec=0)], 1)
    bad = None
except EmberError as exc:
    bad = exc.code
print(json.dumps({"raw": raw_digest, "missing": missing, "content": content, "bad": bad, "order": preloaded()}))
""",
        mode="load",
        env={"TEST_DIR": str(tmp_path)},
    )
    r = _last_json(out)
    assert r["raw"][0] == -10 and "uncompressed bytes do not match their digest" in r["raw"][1]
    assert r["missing"][0] == -5 and "blob 'kernel_images/2'" in r["missing"][1] and "No such file" in r["missing"][1]
    assert r["content"][0] == -10 and "do not hash to" in r["content"][1]
    assert r["bad"] == -1  # a raw size of 0 is refused before any thread starts
    assert r["order"] == []  # none of them reached the loaders

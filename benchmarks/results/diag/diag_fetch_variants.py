"""Where the sidecar's fetch time goes (loopback MinIO of `e2e/cluster.sh up`, 250 MB archive):
one transfer manager with the sidecar's in-order hashing writer, the same without hashing
(non-seekable and seekable targets), hashing on a separate thread, and boto3's download_file
per blob. Runs interleaved; prints median and best seconds per variant.

    python3 benchmarks/results/diag/diag_fetch_variants.py [runs]
"""

import hashlib
import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from s3transfer.manager import TransferManager
from s3transfer.subscribers import BaseSubscriber

from ember.store import HashingWriter, open_store
from ember_sidecar.s3fetch import _ProvideSize
from ember_testing.archives import sample_identity, write_bundle_archive
from ember_testing.cluster import e2e_env as _find_minio_env

env = _find_minio_env()
os.environ.update(env)
endpoint = os.environ.get("EMBER_S3_ENDPOINT") or "http://127.0.0.1:19000"
bucket = os.environ.get("EMBER_S3_BUCKET", "ember-test")
prefix = f"variants/{int(time.time())}"
store = open_store(f"s3://{bucket}/{prefix}", endpoint=endpoint)
m = write_bundle_archive(store, 250, sample_identity("variants"))
keys = [(f"{prefix}/blobs/{b.sha256}", b.sha256, b.compressed_size) for b in m.blobs]
client = boto3.client("s3", endpoint_url=endpoint, config=Config(s3={"addressing_style": "path"}))
cfg = TransferConfig(
    multipart_threshold=8 << 20, multipart_chunksize=8 << 20, max_concurrency=10, use_threads=True
)

sub = type("PS", (_ProvideSize, BaseSubscriber), {})


class NoHash:
    def __init__(self, path):
        self.f = open(path, "wb", buffering=0)  # noqa: SIM115 (closed with the process: a diagnostic)

    def seekable(self):
        return False

    def write(self, d):
        v = memoryview(d)
        while v:
            v = v[self.f.write(v) or 0 :]
        return len(d)


class ThreadHash(NoHash):
    q = None

    def __init__(self, path, digest):
        super().__init__(path)
        self.sha = hashlib.sha256()
        self.digest = digest

    def write(self, d):
        n = super().write(d)
        ThreadHash.q.put((self.sha, d))
        return n


class ChunkHash:
    """Seekable target: writes land at their offsets; each 8 MB piece of the blob is hashed on
    its own (per-piece sha256, in order within the piece) on a shared thread pool."""

    pool = None
    PIECE = 8 << 20

    def __init__(self, path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        self.pos = 0
        self.lock = threading.Lock()
        self.pieces = {}  # index -> [sha, next offset, early dict, lock]
        self.futs = []

    def seekable(self):
        return True

    def seek(self, off, whence=0):
        self.pos = off
        return off

    def tell(self):
        return self.pos

    def write(self, d):
        d = bytes(d)
        off = self.pos
        os.pwrite(self.fd, d, off)
        self.pos += len(d)
        self.futs.append(ChunkHash.pool.submit(self._hash, off, d))
        return len(d)

    def _hash(self, off, d):
        i = off // self.PIECE
        with self.lock:
            piece = self.pieces.setdefault(i, [hashlib.sha256(), i * self.PIECE, {}, threading.Lock()])
        with piece[3]:
            piece[2][off] = d
            while (c := piece[2].pop(piece[1], None)) is not None:
                piece[0].update(c)
                piece[1] += len(c)

    def finish(self):
        for f in self.futs:
            f.result()
        os.close(self.fd)


def hasher_loop(q):
    while (item := q.get()) is not None:
        item[0].update(item[1])


def one_tm(kind, dest, io_chunk=256 << 10, switch=None):
    if switch:
        old = sys.getswitchinterval()
        sys.setswitchinterval(switch)
        try:
            return one_tm(kind, dest, io_chunk)
        finally:
            sys.setswitchinterval(old)
    if kind == "chunks":
        from concurrent.futures import ThreadPoolExecutor

        ChunkHash.pool = ThreadPoolExecutor(8)
    if kind == "thread":
        ThreadHash.q = queue.SimpleQueue()
        th = threading.Thread(target=hasher_loop, args=(ThreadHash.q,))
        th.start()
    cfg.io_chunksize = io_chunk
    tm = TransferManager(store.client, cfg)
    futs = []
    ws = []
    for k, dg, size in keys:
        if kind == "hash":
            w = HashingWriter(dest / dg, dg, size)
        elif kind == "nohash":
            w = NoHash(dest / dg)
        elif kind == "thread":
            w = ThreadHash(dest / dg, dg)
        elif kind == "chunks":
            w = ChunkHash(dest / dg)
        else:
            w = str(dest / dg)
        ws.append(w)
        futs.append(tm.download(bucket, k, w, subscribers=[sub(size)]))
    for f in futs:
        f.result()
    for w in ws:
        if kind in ("hash", "chunks"):
            w.finish("x") if kind == "hash" else w.finish()
    if kind == "thread":
        ThreadHash.q.put(None)
        th.join()
        assert all(w.sha.hexdigest() == w.digest for w in ws)
    tm.shutdown()


def plain(dest):
    for k, dg, _size in keys:
        client.download_file(bucket, k, str(dest / dg))


variants = {
    "tm+hash (sidecar)": lambda d: one_tm("hash", d),
    "tm nohash nonseek": lambda d: one_tm("nohash", d),
    "tm + hash thread": lambda d: one_tm("thread", d),
    "tm seekable files": lambda d: one_tm("file", d),
    "tm seek+piece hashes": lambda d: one_tm("chunks", d),
    "tm+hash io 1MB": lambda d: one_tm("hash", d, 1 << 20),
    "tm+hash io 4MB": lambda d: one_tm("hash", d, 4 << 20),
    "tm+hash switch 0.5ms": lambda d: one_tm("hash", d, switch=5e-4),
    "boto3 download_file": plain,
}
res: dict[str, list[float]] = {k: [] for k in variants}
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 8):
    for name, fn in variants.items() if i % 2 == 0 else reversed(list(variants.items())):
        d = Path(tempfile.mkdtemp())
        os.sync()
        t = time.perf_counter()
        fn(d)
        res[name].append(time.perf_counter() - t)
        shutil.rmtree(d)
for k, v in res.items():
    print(f"{k:22s} median {statistics.median(v):.3f} min {min(v):.3f}")
buf = os.urandom(256 << 10)
h = hashlib.sha256()
t = time.perf_counter()
for _ in range(400):
    h.update(buf)
print(f"sha256 one thread {100 / (time.perf_counter() - t):.0f} MB/s")

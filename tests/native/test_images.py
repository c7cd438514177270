"""Sizing in-memory kernel images by magic number (fatbin wrapper v1/v2, fatbin chains, ELF
cubins, PTX) with no over-read: every crafted, truncated or hostile input is placed so that it
ends exactly at a PROT_NONE guard page, and a brief deterministic mutation fuzz checks that no
input faults and that every size reported fits in the bytes that exist."""

from __future__ import annotations

import ctypes
import mmap
import random
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ember.native import EmberError, Interposer

PAGE = mmap.PAGESIZE
FATBIN, WRAPPER = 0xBA55ED50, 0x466243B1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


@pytest.fixture(scope="module")
def ip(libember: Path) -> Interposer:
    return Interposer.attach(libember)


class Guarded:
    """Buffers that end right before a PROT_NONE page: reading one byte too far would fault."""

    def __init__(self, pages: int = 64) -> None:
        self.map = mmap.mmap(-1, (pages + 1) * PAGE)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.guard = self.base + pages * PAGE
        assert _libc.mprotect(self.guard, PAGE, 0) == 0

    def place(self, data: bytes) -> int:
        assert len(data) <= self.guard - self.base
        addr = self.guard - len(data)
        ctypes.memmove(addr, data, len(data))
        return addr


@contextmanager
def guarded(pages: int = 64) -> Iterator[Guarded]:
    g = Guarded(pages)
    yield g
    _libc.mprotect(g.guard, PAGE, 3)


def fatbin(body: bytes, header_size: int = 16) -> bytes:
    return struct.pack("<IHHQ", FATBIN, 1, header_size, len(body)) + b"\0" * (header_size - 16) + body


def elf(sections: list[tuple[int, int, int]], shoff: int, total: int) -> bytes:
    """A minimal ELF64: (type, offset, size) sections, section table at shoff, padded to total."""
    ident = b"\x7fELF" + bytes([2, 1, 1]) + b"\0" * 9
    hdr = ident + struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(sections), 0)
    buf = bytearray(max(total, shoff + 64 * len(sections)))
    buf[:64] = hdr
    for i, (typ, off, size) in enumerate(sections):
        entry = struct.pack("<IIQQQQIIQQ", 0, typ, 0, 0, off, size, 0, 0, 1, 0)
        buf[shoff + 64 * i: shoff + 64 * (i + 1)] = entry
    return bytes(buf)


def test_fatbin_single_chain_and_trailer(ip: Interposer) -> None:
    one = fatbin(b"x" * 1000)
    two = one + fatbin(b"y" * 333, header_size=24)
    with guarded() as g:
        assert ip.image_size(g.place(one)) == ("fatbin", 1016)
        assert ip.image_size(g.place(two)) == ("fatbin", 1016 + 24 + 333)  # the chain ends at the guard
        assert ip.image_size(g.place(one + b"\x01\x02\x03\x04garbage" * 4)) == ("fatbin", 1016)
        assert ip.image_size(g.place(one + b"\x50\xed")) == ("fatbin", 1016)  # half a magic before the guard


def test_fatbin_truncated_and_hostile(ip: Interposer) -> None:
    with guarded() as g:
        for data in (
            fatbin(b"x" * 1000)[:-1],                                   # body one byte short
            struct.pack("<IHHQ", FATBIN, 1, 16, 1 << 62),               # absurd size
            struct.pack("<IHHQ", FATBIN, 1, 8, 16),                     # header smaller than itself
            struct.pack("<IHH", FATBIN, 1, 16),                         # truncated header
        ):
            with pytest.raises(EmberError):
                ip.image_size(g.place(data))
        addr = g.place(fatbin(b"z" * 100))
        with pytest.raises(EmberError):
            ip.image_size(addr, limit=50)                               # the caller's limit is respected


def test_wrapper_v1_v2_and_bad_wrappers(ip: Interposer) -> None:
    with guarded() as g:
        fb = g.place(fatbin(b"k" * 500))
        w1 = struct.pack("<iiQQ", WRAPPER, 1, fb, 0)
        # version 2 lists further fatbins in a NULL-terminated array (linked at SAVE time)
        w2 = struct.pack("<iiQQ", WRAPPER, 2, fb, 0)
        buf = ctypes.create_string_buffer(w1 + w2)
        addr = ctypes.addressof(buf)
        assert ip.image_size(addr) == ("wrapper", 516)
        assert ip.image_size(addr + 24) == ("wrapper", 516)
        chained = g.place(fatbin(b"k" * 500) + fatbin(b"next translation unit"))
        wc = ctypes.create_string_buffer(struct.pack("<iiQQ", WRAPPER, 1, chained, 0))
        assert ip.image_size(ctypes.addressof(wc)) == ("wrapper", 516)   # its own fatbin only
        for bad in (struct.pack("<iiQQ", WRAPPER, 7, fb, 0), struct.pack("<iiQQ", WRAPPER, 1, 0, 0),
                    struct.pack("<iiQQ", WRAPPER, 1, g.guard, 0), struct.pack("<iiQQ", WRAPPER, 1, addr, 0)):
            b = ctypes.create_string_buffer(bad)
            with pytest.raises(EmberError):
                ip.image_size(ctypes.addressof(b))
        with pytest.raises(EmberError):
            ip.image_size(g.place(struct.pack("<ii", WRAPPER, 1)))      # truncated wrapper


def test_elf_sizes(ip: Interposer) -> None:
    img = elf([(1, 64, 100), (8, 0, 1 << 40), (1, 300, 50)], shoff=400, total=0)  # NOBITS sizes ignored
    with guarded() as g:
        assert ip.image_size(g.place(img)) == ("elf", 400 + 3 * 64)
        tail = elf([(1, 64, 2000)], shoff=200, total=2064)                # a section past the table
        assert ip.image_size(g.place(tail)) == ("elf", 2064)
        for bad in (img[:-1], elf([(1, 64, 1 << 50)], 200, 0), img[:40]):
            with pytest.raises(EmberError):
                ip.image_size(g.place(bad))


def test_real_shared_objects_size_to_their_file_length(ip: Interposer, libember: Path, standin) -> None:
    for path in (libember, standin.dir / "libcuda.so.1"):
        data = path.read_bytes()
        with guarded(pages=len(data) // PAGE + 2) as g:
            assert ip.image_size(g.place(data)) == ("elf", len(data))


def test_ptx(ip: Interposer) -> None:
    text = b"//\n.version 8.0\n.target sm_90\n.entry k()\n{ ret; }\n\0"
    with guarded() as g:
        assert ip.image_size(g.place(text)) == ("ptx", len(text))
        with pytest.raises(EmberError):
            ip.image_size(g.place(text[:-1]))                           # no NUL before the guard
        with pytest.raises(EmberError):
            ip.image_size(g.place(b"\x01\x02binary junk\0"))
        long_text = b".version 8.0\n" + b"// filler\n" * 3000 + b"\0"   # spans pages
        assert ip.image_size(g.place(long_text)) == ("ptx", len(long_text))


def test_unreadable_and_null(ip: Interposer) -> None:
    with guarded() as g, pytest.raises(EmberError):
        ip.image_size(g.guard)
    with pytest.raises(EmberError):
        ip.image_size(0)


def test_hash_is_stable_and_content_keyed(ip: Interposer) -> None:
    a = ip.hash(b"kernel image bytes")
    assert a == ip.hash(b"kernel image bytes") and len(a) == 32
    assert a != ip.hash(b"kernel image byteS") and ip.hash(b"") != ip.hash(b"\0")
    sizes = {ip.hash(bytes(n)) for n in range(0, 200)}                 # every length branch
    assert len(sizes) == 200


def test_fuzz_mutations_never_fault_or_over_read(ip: Interposer) -> None:
    rng = random.Random(1234)
    seeds = [
        fatbin(b"a" * 300) + fatbin(b"b" * 77),
        elf([(1, 64, 100), (1, 300, 50)], shoff=400, total=0),
        b".version 8.0\n.entry k()\n{}\n\0",
    ]
    deadline = time.monotonic() + 3.0
    runs = 0
    with guarded() as g:
        while time.monotonic() < deadline:
            data = bytearray(rng.choice(seeds))
            for _ in range(rng.randint(1, 8)):
                op = rng.random()
                if op < 0.5 and data:
                    data[rng.randrange(len(data))] = rng.randrange(256)
                elif op < 0.7 and len(data) > 8:
                    i = rng.randrange(0, len(data) - 8)
                    word = rng.choice([0, 1 << 63, 0xFFFFFFFF, rng.getrandbits(64)])
                    data[i:i + 8] = struct.pack("<Q", word)
                elif op < 0.85:
                    del data[rng.randrange(len(data) + 1):]
                else:
                    data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
            if not data:
                continue
            addr = g.place(bytes(data))
            try:
                kind, size = ip.image_size(addr)
            except EmberError:
                continue
            finally:
                runs += 1
            assert 0 < size <= len(data), (kind, size, len(data))
    assert runs > 1000

"""Kernel images cut to one architecture and the kernels used (ember.archive.kernel_images).

The fixtures are real nvcc output (tests/data/kernel_images/build.sh, CUDA 13): a sm_90 cubin
with four kernels, and a fatbin with compressed sm_80/sm_90 entries plus PTX whose sm_90 entry
cuobjdump extracted. That the driver loads a cut image and its kernels compute the same is
tests/gpu/test_kernel_images_gpu.py.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from ember.archive import kernel_images as ki

DATA = Path(__file__).resolve().parents[1] / "data" / "kernel_images"
KERNELS = {"uses_helper", "checks", "plain", "unused"}


@pytest.fixture(scope="module")
def cubin() -> bytes:
    return (DATA / "fixture.sm_90.cubin").read_bytes()


def kernels(elf: bytes) -> set[str]:
    """The kernel entry points an ELF defines (what the driver makes kernels of)."""
    e = ki._read(elf)
    return {n for n, s in zip(e.sym_names, e.syms, strict=True) if s[1] & 0xF == 2 and s[2] & 0x10 and s[3]}


def section(elf: bytes, name: str) -> bytes | None:
    e = ki._read(elf)
    i = e.named(name)
    return None if i is None or e.secs[i].type == 0 else e.bytes_of(elf, i)


def test_the_sm_90_cubin_of_a_compressed_fatbin_is_what_cuobjdump_extracts() -> None:
    fat = (DATA / "fixture.fatbin").read_bytes()
    assert ki.is_fatbin(fat) and b"\x7fELF" not in fat  # every entry compressed: zstd is exercised
    assert ki.fatbin_cubin(fat, 90) == (DATA / "fixture.fatbin.sm_90.cubin").read_bytes()
    assert ki.fatbin_cubin(fat, 80) is not None and ki.fatbin_cubin(fat, 80) != ki.fatbin_cubin(fat, 90)
    assert ki.fatbin_cubin(fat, 75) is None  # no such entry (only PTX would serve it)


def test_a_fatbin_cut_short_is_refused() -> None:
    fat = (DATA / "fixture.fatbin").read_bytes()
    with pytest.raises(ki.ImageFormatError):
        ki.fatbin_cubin(fat[: len(fat) // 2], 90)


def test_prune_keeps_the_named_kernels_and_drops_the_others(cubin: bytes) -> None:
    assert kernels(cubin) == KERNELS
    cut = ki.prune(cubin, {"uses_helper", "checks"})
    assert kernels(cut) == {"uses_helper", "checks"}
    assert len(cut) < len(cubin)
    # the kept kernels' code and parameter banks are byte for byte the same
    for name in (".text.uses_helper", ".text.checks", ".nv.constant0.uses_helper", ".nv.info.checks"):
        assert section(cut, name) == section(cubin, name)
    assert section(cut, ".text.unused") is None and section(cut, ".text.plain") is None
    assert b"unused" not in cut  # the string tables hold the kept names only
    # the helper compiled into uses_helper's section, and the relocations that patch it, stay
    assert section(cut, ".rela.text.uses_helper") == section(cubin, ".rela.text.uses_helper")


def test_prune_keeps_every_section_and_symbol_at_its_index(cubin: bytes) -> None:
    whole, cut = ki._read(cubin), ki._read(ki.prune(cubin, {"plain"}))
    assert len(cut.secs) == len(whole.secs) and len(cut.syms) == len(whole.syms)
    for a, b in zip(whole.secs, cut.secs, strict=True):
        if b.type:  # kept: same kind, same links (relocations and .nv.info refer to them by index)
            assert (a.name, a.type, a.link, a.info, a.flags) == (b.name, b.type, b.link, b.info, b.flags)


def test_the_call_graph_loses_only_the_edges_of_dropped_kernels(cubin: bytes) -> None:
    e = ki._read(cubin)
    checks, assertfail = e.sym_names.index("checks"), e.sym_names.index("__assertfail")
    assert (checks, assertfail) in ki._calls(cubin, e)
    kept = ki.prune(cubin, {"checks"})
    assert (checks, assertfail) in ki._calls(kept, ki._read(kept))
    dropped = ki.prune(cubin, {"plain"})
    calls = ki._calls(dropped, ki._read(dropped))
    assert (checks, assertfail) not in calls
    assert [c for c in calls if c[0] == 0] == [
        c for c in ki._calls(cubin, e) if c[0] == 0
    ]  # the driver's own


def test_segments_cover_the_kept_sections_and_stay_inside_the_file(cubin: bytes) -> None:
    cut = ki.prune(cubin, {"uses_helper"})
    e = ki._read(cut)
    phoff, phnum = int(e.header[5]), int(e.header[10])
    segments = [ki._PHDR.unpack_from(cut, phoff + k * ki._PHDR.size) for k in range(phnum)]
    assert phnum and all(off + filesz <= len(cut) for _, _, off, _, _, filesz, _, _ in segments)
    text = e.secs[e.named(".text.uses_helper") or 0]
    code = [s for s in segments if s[0] == 1 and s[1] & 1]  # PT_LOAD, executable
    assert any(
        off <= text.offset and text.offset + text.size <= off + filesz
        for _, _, off, _, _, filesz, _, _ in code
    )


def test_prune_is_deterministic_and_refuses_unknown_kernels(cubin: bytes) -> None:
    assert ki.prune(cubin, {"plain"}) == ki.prune(cubin, {"plain"})
    with pytest.raises(ki.ImageFormatError, match="no kernel"):
        ki.prune(cubin, {"not_there"})
    with pytest.raises(ki.ImageFormatError):
        ki.prune(b"\x7fELF\x01" + bytes(60), {"plain"})  # ELF32: not a cubin this reads
    bad = bytearray(cubin)
    struct.pack_into("<H", bad, 58, 40)  # e_shentsize
    with pytest.raises(ki.ImageFormatError):
        ki.prune(bytes(bad), {"plain"})


def test_damaged_images_are_refused_not_crashed_on(cubin: bytes) -> None:
    with pytest.raises(ki.ImageFormatError):
        ki.prune(cubin[: len(cubin) // 3], {"plain"})  # section headers past the end
    fat = bytearray((DATA / "fixture.fatbin").read_bytes())
    frame = fat.rfind(b"\x28\xb5\x2f\xfd")  # the last entry's zstd frame: the sm_90 cubin
    fat[frame + 8 : frame + 40] = bytes(32)
    with pytest.raises(ki.ImageFormatError, match="decompress"):
        ki.fatbin_cubin(bytes(fat), 90)

"""Kernel images cut down to what the graphs use: one architecture's cubin, only the used kernels.

A framework's fatbin carries one compressed cubin per architecture, and each cubin carries every
kernel of its translation unit: torch's elementwise fatbins hold up to 434 kernels, of which a
decode graph runs one to four. The driver's load cost follows the size of the cubin it loads (a whole
LOAD's fatbins decompress to ~120 MB of sm_90 ELF), so SAVE stores instead, per image:

- `fatbin_cubin(fatbin, arch)`: this architecture's ELF entry, decompressed;
- `prune(cubin, names)`: that cubin with the code of every other kernel left out.

`prune` keeps every section and symbol at its index, so nothing that refers to them by number
(relocations, the `.nv.info` attributes, the call graph) needs rewriting. A kernel that is not
kept loses its per-kernel sections (their headers become inactive, their contents go), its symbol
stops being a kernel entry, and its call-graph edges go (the driver refuses an edge from a symbol
that is no longer a function); the string tables keep the kept names only. Functions a kept
kernel reaches (a call-graph edge, or a relocation against another `.text.<name>` section) are
kept too. The archive stays correct without any of this: SAVE proves the graphs rebuilt from the
cut images, and keeps an image whole where cutting fails.

Layouts: ELF64 (the System V gABI); the fatbin container (a 16-byte header, then per entry a
header whose size it gives, then the payload; a compressed payload is a zstd frame).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

FATBIN_MAGIC = 0xBA55ED50
_FATBIN_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of what follows
_ENTRY_HEAD = struct.Struct("<HHIQI")  # kind, version, header size, padded payload size, payload size
_ENTRY_ELF = 2
_ENTRY_COMPRESSED = 0x8000  # in the entry's flags (u64 at +40); the uncompressed size is at +56
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_PHDR = struct.Struct("<IIQQQQQQ")
_SYM = struct.Struct("<IBBHQQ")
_SHT_SYMTAB, _SHT_RELA, _SHT_NOBITS, _SHT_REL = 2, 4, 8, 9
_STT_FUNC, _STT_NOTYPE = 2, 0
_STO_CUDA_ENTRY = 0x10
_PT_LOAD, _PT_PHDR = 1, 6


class ImageFormatError(ValueError):
    """The bytes are not the format they claim, or use a part of it this module does not know."""


def is_fatbin(data: bytes) -> bool:
    return len(data) >= _FATBIN_HEADER.size and struct.unpack_from("<I", data)[0] == FATBIN_MAGIC


def is_cubin(data: bytes) -> bool:
    return data[:4] == b"\x7fELF" and data[4] == 2  # ELF64


def fatbin_cubin(data: bytes, arch: int) -> bytes | None:
    """The ELF entry for sm_`arch` of a single fatbin, decompressed; None when it has none (or
    only PTX, or more than one such entry, which would need the driver's own choice)."""
    import zstandard

    magic, _, hsize, body = _FATBIN_HEADER.unpack_from(data)
    if magic != FATBIN_MAGIC or hsize + body > len(data):
        raise ImageFormatError("not a single, whole fatbin")
    found: list[bytes] = []
    pos, end = hsize, hsize + body
    while pos + 64 <= end:
        kind, _, ehsize, padded, size = _ENTRY_HEAD.unpack_from(data, pos)
        if ehsize < 64 or pos + ehsize + size > end:
            raise ImageFormatError(f"fatbin entry at {pos} overruns its container")
        entry_arch = struct.unpack_from("<I", data, pos + 28)[0]
        flags, raw_size = (
            struct.unpack_from("<Q", data, pos + 40)[0],
            struct.unpack_from("<Q", data, pos + 56)[0],
        )
        if kind == _ENTRY_ELF and entry_arch == arch:
            payload = data[pos + ehsize : pos + ehsize + size]
            if flags & _ENTRY_COMPRESSED:
                if payload[:4] != _ZSTD_MAGIC:
                    return None  # another compression (older toolkits): leave the fatbin whole
                try:
                    payload = zstandard.ZstdDecompressor().decompress(
                        payload, max_output_size=raw_size or 1 << 31
                    )
                except zstandard.ZstdError as e:
                    raise ImageFormatError(f"fatbin entry at {pos} does not decompress: {e}") from e
            found.append(payload)
        pos += ehsize + padded
    return found[0] if len(found) == 1 and is_cubin(found[0]) else None


@dataclass
class _Section:
    name: str
    type: int
    flags: int
    addr: int
    offset: int
    size: int
    link: int
    info: int
    align: int
    entsize: int


def _cstr(table: bytes, off: int) -> str:
    return table[off : table.index(b"\0", off)].decode("utf-8", "replace")


def _owner(name: str, functions: set[str]) -> str | None:
    """The function a per-function section belongs to (`.text.f`, `.nv.info.f`, `.rela.text.f`, ...)."""
    i = name.find(".", 1)
    while i != -1:
        if name[i + 1 :] in functions:
            return name[i + 1 :]
        i = name.find(".", i + 1)
    return None


@dataclass
class _Elf:
    header: list[int | bytes]  # the ELF header's fields, in order
    secs: list[_Section]
    symtab: int
    syms: list[list[int]]  # name, info, other, shndx, value, size
    sym_names: list[str]

    def bytes_of(self, elf: bytes, i: int) -> bytes:
        return elf[self.secs[i].offset : self.secs[i].offset + self.secs[i].size]

    def named(self, name: str) -> int | None:
        return next((i for i, s in enumerate(self.secs) if s.name == name), None)


def _read(elf: bytes) -> _Elf:
    header = list(_EHDR.unpack_from(elf))
    ident, phentsize, shoff, shentsize, shnum, shstrndx = (header[i] for i in (0, 9, 6, 11, 12, 13))
    assert isinstance(ident, bytes)
    if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
        raise ImageFormatError("not a little-endian ELF64 cubin")
    if shentsize != _SHDR.size or phentsize not in (0, _PHDR.size) or not shnum:
        raise ImageFormatError("unexpected ELF header sizes")
    raw = [_SHDR.unpack_from(elf, int(shoff) + i * _SHDR.size) for i in range(int(shnum))]
    secs = [_Section("", *r[1:]) for r in raw]
    shstr = elf[secs[int(shstrndx)].offset :][: secs[int(shstrndx)].size]
    for s, r in zip(secs, raw, strict=True):
        s.name = _cstr(shstr, r[0])
    symtab = next((i for i, s in enumerate(secs) if s.type == _SHT_SYMTAB), None)
    if symtab is None:
        raise ImageFormatError("cubin without a symbol table")
    st = secs[symtab]
    strtab = elf[secs[st.link].offset :][: secs[st.link].size]
    syms = [list(_SYM.unpack_from(elf, st.offset + i * _SYM.size)) for i in range(st.size // _SYM.size)]
    return _Elf(header, secs, symtab, syms, [_cstr(strtab, s[0]) for s in syms])


def _calls(elf: bytes, e: _Elf) -> list[tuple[int, int]]:
    """The call graph's entries (caller, callee symbol); caller 0 marks the driver's own entries."""
    cg = e.named(".nv.callgraph")
    data = e.bytes_of(elf, cg) if cg is not None else b""
    return [struct.unpack_from("<II", data, p) for p in range(0, len(data) - 7, 8)]


def _reachable(
    elf: bytes, e: _Elf, keep: set[str], functions: set[str], calls: list[tuple[int, int]]
) -> set[str]:
    """`keep` and every function they reach: their calls (the call graph) and their code's
    relocations against another function's section."""
    secs, syms = e.secs, e.syms
    reaches: dict[str, set[int]] = {}
    for caller, callee in calls:
        if caller and caller < len(syms) and callee < len(syms):
            reaches.setdefault(e.sym_names[caller], set()).add(callee)
    for s in secs:
        if s.type in (_SHT_RELA, _SHT_REL) and secs[s.info].name.startswith(".text."):
            size = 24 if s.type == _SHT_RELA else 16
            for off in range(s.offset, s.offset + s.size - size + 1, size):
                sym = struct.unpack_from("<Q", elf, off + 8)[0] >> 32
                reaches.setdefault(secs[s.info].name[len(".text.") :], set()).add(sym)
    kept, todo = set(keep), list(keep)
    while todo:
        for sym in reaches.get(todo.pop(), ()):
            if sym < len(syms) and syms[sym][3] < len(secs):
                owner = _owner(secs[syms[sym][3]].name, functions)
                if owner is not None and owner not in kept:
                    kept.add(owner)
                    todo.append(owner)
    return kept


def prune(elf: bytes, keep: set[str]) -> bytes:
    """`elf` with the code of every kernel not in `keep` (nor called by one that is) left out.
    Raises ImageFormatError for a name `elf` does not define or a layout this does not know."""
    try:
        return _prune(elf, keep)
    except (struct.error, IndexError, UnicodeDecodeError) as e:  # offsets past the end, bad tables
        raise ImageFormatError(f"the cubin is damaged or not laid out as expected: {e}") from e


def _prune(elf: bytes, keep: set[str]) -> bytes:
    e = _read(elf)
    secs, syms = e.secs, e.syms
    text = {s.name[len(".text.") :]: i for i, s in enumerate(secs) if s.name.startswith(".text.")}
    functions = {n for n, s in zip(e.sym_names, syms, strict=True) if s[1] & 0xF == _STT_FUNC and n in text}
    missing = keep - functions
    if missing:
        raise ImageFormatError(f"the cubin defines no kernel {sorted(missing)[0]}")

    calls = _calls(elf, e)
    kept = _reachable(elf, e, keep, functions, calls)
    dropped = {
        i for i, s in enumerate(secs) if (o := _owner(s.name, functions)) is not None and o not in kept
    }
    gone = {k for k, s in enumerate(syms) if s[3] in dropped}
    for k in gone:
        if syms[k][1] & 0xF == _STT_FUNC:  # no entry point, no size: the driver makes no kernel of it
            syms[k][1] = (syms[k][1] & 0xF0) | _STT_NOTYPE
            syms[k][2] &= ~_STO_CUDA_ENTRY
            syms[k][5] = 0

    # The names are most of what is left (thousands of long mangled names): both string tables
    # are rebuilt with the kept names only; a dropped section becomes an inactive (NULL) header.
    # The call graph loses the edges of dropped functions (the driver refuses an edge from a
    # symbol that is no longer a function).
    shstrndx, strndx = int(e.header[13]), secs[e.symtab].link
    section_names = ["" if i in dropped else s.name for i, s in enumerate(secs)]
    symbol_names = ["" if k in gone else n for k, n in enumerate(e.sym_names)]
    blobs: dict[int, bytes] = {}
    if strndx == shstrndx:
        offs, blobs[shstrndx] = _strings(section_names + symbol_names)
        name_offs, sym_offs = offs[: len(secs)], offs[len(secs) :]
    else:
        name_offs, blobs[shstrndx] = _strings(section_names)
        sym_offs, blobs[strndx] = _strings(symbol_names)
    for sym, off in zip(syms, sym_offs, strict=True):
        sym[0] = off
    blobs[e.symtab] = b"".join(_SYM.pack(*s) for s in syms)
    cg = e.named(".nv.callgraph")
    if cg is not None:
        blobs[cg] = b"".join(struct.pack("<II", a, b) for a, b in calls if a not in gone and b not in gone)
    return _write(elf, e, dropped, blobs, name_offs)


def _write(elf: bytes, e: _Elf, dropped: set[int], blobs: dict[int, bytes], name_offs: list[int]) -> bytes:
    """The new file: header, then every section's bytes in the original file order (so each
    segment stays one contiguous run), then the section headers, then the program headers."""
    secs = e.secs
    types = [s.type for s in secs]
    out = bytearray(_EHDR.size)
    where: dict[int, tuple[int, int]] = {}
    for i in sorted(range(1, len(secs)), key=lambda i: secs[i].offset):
        s = secs[i]
        if types[i] == _SHT_NOBITS:
            where[i] = (len(out), 0 if i in dropped else s.size)
            continue
        data = blobs[i] if i in blobs else b"" if i in dropped else e.bytes_of(elf, i)
        out += b"\0" * (-len(out) % max(s.align, 1))
        where[i] = (len(out), len(data))
        out += data
    out += b"\0" * (-len(out) % 8)
    shoff = len(out)
    for i, s in enumerate(secs):
        off, size = where.get(i, (0, 0))
        out += _SHDR.pack(
            name_offs[i],
            0 if i in dropped else s.type,
            s.flags,
            s.addr,
            off,
            size,
            s.link,
            s.info,
            s.align,
            s.entsize,
        )
    phoff, phnum = len(out), int(e.header[10])
    out += _phdrs(elf, int(e.header[5]), phnum, secs, types, where, phoff)
    header = list(e.header)
    header[5], header[6] = (phoff if phnum else 0), shoff
    out[: _EHDR.size] = _EHDR.pack(*header)
    return bytes(out)


def _strings(strings: list[str]) -> tuple[list[int], bytes]:
    """A string table holding `strings` (each once) and each one's offset in it; "" is at 0."""
    table, at = bytearray(b"\0"), {"": 0}
    for x in strings:
        if x not in at:
            at[x] = len(table)
            table += x.encode() + b"\0"
    return [at[x] for x in strings], bytes(table)


def _phdrs(
    elf: bytes,
    phoff: int,
    phnum: int,
    secs: list[_Section],
    types: list[int],
    where: dict[int, tuple[int, int]],
    new_phoff: int,
) -> bytes:
    """The program headers, each segment moved to where its sections now are."""
    out = b""
    table = phnum * _PHDR.size
    for k in range(phnum):
        ptype, pflags, off, vaddr, paddr, filesz, memsz, align = _PHDR.unpack_from(
            elf, phoff + k * _PHDR.size
        )
        if ptype == _PT_PHDR or (ptype == _PT_LOAD and off == phoff and filesz == table):
            off, filesz, memsz = new_phoff, table, table
        elif filesz:
            inside = [
                i
                for i, s in enumerate(secs)
                if i
                and types[i] != _SHT_NOBITS
                and s.size
                and off <= s.offset
                and s.offset + s.size <= off + filesz
            ]
            if not inside:
                raise ImageFormatError(f"segment {k} holds no section")
            start = min(where[i][0] for i in inside)
            end = max(where[i][0] + where[i][1] for i in inside)
            off, memsz, filesz = start, end - start + (memsz - filesz), end - start
        out += _PHDR.pack(ptype, pflags, off, vaddr, paddr, filesz, memsz, align)
    return out

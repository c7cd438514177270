# ruff: noqa: E501  (embedded C-call snippets read better unwrapped)
"""libember_nccl, the communication stub a multi-GPU SAVE runs under, against the stand-in
driver: fake communicators, one placeholder memset per collective (one per group), the call
records, refusals, and its memory kept out of libember's fixed-base region."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SNIPPET = """
stub = ctypes.CDLL("libember_nccl.so", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
vp, sz, ci = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
ip.arm()
comm = vp()
class UniqueId(ctypes.Structure):  # passed BY VALUE, as nccl.h declares
    _fields_ = [("internal", ctypes.c_char * 128)]
uid = UniqueId()
assert stub.ncclGetUniqueId(ctypes.byref(uid)) == 0 and uid.internal.startswith(b"ember")
assert stub.ncclCommInitRank(ctypes.byref(comm), 4, uid, 0) == 0
n, r = ci(), ci()
assert stub.ncclCommCount(comm, ctypes.byref(n)) == 0 and stub.ncclCommUserRank(comm, ctypes.byref(r)) == 0
buf = alloc(1 << 20)  # the engine's memory: served by the region
stream = vp(0x5000)
rc = [stub.ncclAllReduce(vp(buf), vp(buf), sz(4096), ci(9), ci(0), comm, stream)]
rc.append(stub.ncclGroupStart())
for peer in range(4):
    rc.append(stub.ncclSend(vp(buf + peer * 64), sz(16), ci(9), ci(peer), comm, stream))
    rc.append(stub.ncclRecv(vp(buf + 4096 + peer * 64), sz(16), ci(9), ci(peer), comm, stream))
rc.append(stub.ncclGroupEnd())
rc.append(stub.ncclAllGather(vp(buf), vp(buf + 8192), sz(128), ci(7), comm, stream))
split = stub.ncclCommSplit(comm, 0, 0, ctypes.byref(vp()), None)
bad = stub.ncclAllReduce(vp(buf), vp(buf), sz(1), ci(9), ci(0), vp(0), stream)  # no communicator
stub.ember_nccl_scratch.restype = ctypes.c_ulonglong
stub.ember_nccl_calls.restype = ctypes.c_size_t
need = stub.ember_nccl_calls(None, 0)
out = ctypes.create_string_buffer(need)
stub.ember_nccl_calls(out, need)
base, size = ip.region()
print(json.dumps({"n": n.value, "r": r.value, "rc": rc, "split": split, "bad": bad, "buf": buf,
                  "scratch": stub.ember_nccl_scratch(), "base": base, "size": size,
                  "calls": out.value.decode().splitlines(), "driver": calls(),
                  "log": ip.export_alloc_log().decode()}))
"""


@pytest.fixture
def stub_lib(libember: Path) -> Path:
    stub = libember.with_name("libember_nccl.so")
    assert stub.is_file(), f"{stub}: libember's build makes the NCCL stub beside it"
    return stub


def test_collectives_become_placeholders_and_records(run_py, libember: Path, stub_lib: Path) -> None:
    out = run_py(SNIPPET, mode="save", env={"LD_PRELOAD": f"{libember}:{stub_lib}"})
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert (r["n"], r["r"]) == (4, 0)
    assert r["rc"] == [0] * len(r["rc"])
    assert r["split"] == 5 and r["bad"] == 4  # ncclInvalidUsage, ncclInvalidArgument
    scratch = r["scratch"]
    # One memset of the scratch word per placeholder, valued by its sequence number: the
    # all-reduce (1), the group of 8 point-to-point calls (2), the all-gather (3).
    memsets = [c for c in r["driver"] if c.startswith("cuMemsetD32Async:")]
    assert memsets == [f"cuMemsetD32Async:{scratch:x}:{seq}:1" for seq in (1, 2, 3)]
    calls = [json.loads(line) for line in r["calls"]]
    assert [c["seq"] for c in calls] == [1] + [2] * 8 + [3]
    first = calls[0]
    assert (first["op"], first["count"], first["dtype"], first["redop"], first["send"], first["nranks"]) == (
        "all_reduce", 4096, 9, 0, r["buf"], 4)
    assert sorted(c["root"] for c in calls if c["op"] == "send") == [0, 1, 2, 3]
    assert calls[-1]["op"] == "all_gather" and calls[-1]["recv"] == r["buf"] + 8192
    # The engine's buffer comes from the region; the stub's scratch does not, and is not logged.
    assert r["base"] <= r["buf"] < r["base"] + r["size"]
    assert not r["base"] <= scratch < r["base"] + r["size"]
    assert "libember_nccl" not in r["log"]


def test_stub_exports_everything_torch_links_from_nccl(stub_lib: Path) -> None:
    """Any NCCL symbol torch imports and the stub lacks would reach the real library with a
    fake communicator. The list is libtorch_cuda.so's (torch 2.11, NCCL 2.28), kept beside the
    stub; tests/gpu checks it against the torch on the GPU machine."""
    import subprocess

    want = (Path(__file__).resolve().parents[2] / "native" / "src" / "nccl_symbols.txt").read_text().split()
    nm = subprocess.run(["nm", "-D", "--defined-only", str(stub_lib)], capture_output=True, text=True, check=True)
    have = {line.split()[-1] for line in nm.stdout.splitlines()}
    assert want and not set(want) - have


CAPTURE = """
stub = ctypes.CDLL("libember_nccl.so", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
from ember.native import EmberError
ip.arm()
comm = ctypes.c_void_p()
class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]
assert stub.ncclCommInitRank(ctypes.byref(comm), 2, UniqueId(), 0) == 0
buf = alloc(1 << 20)
# (op, dtype, redop, root, send, recv, count): an all-reduce, a group exchanging with both ranks,
# an all-gather. Placeholder i's calls are what the splice of rank r issues on its stream.
groups = [[(0, 9, 0, -1, buf, buf, 4096)],
          [(6, 9, -1, p, buf + 64 * p, 0, 16) for p in range(2)] + [(7, 9, -1, p, 0, buf + 4096 + 64 * p, 16) for p in range(2)],
          [(1, 7, -1, -1, buf, buf + 8192, 128)]]
graphs, shapes = ip.capture_collectives(comm.value, groups)
need = stub.ember_nccl_calls(None, 0)
out = ctypes.create_string_buffer(need)
stub.ember_nccl_calls(out, need)
try:
    ip.capture_collectives(comm.value, [[(42, 9, 0, -1, buf, buf, 1)]])
    refused = ""
except EmberError as exc:
    refused = str(exc)
print(json.dumps({"graphs": graphs, "shapes": shapes, "calls": out.value.decode().splitlines(),
                  "driver": [c for c in calls() if c.startswith("capture:") or c == "cuStreamDestroy_v2"],
                  "refused": refused}))
"""


def test_a_ranks_collectives_are_captured_natively_one_graph_each(run_py, libember: Path, stub_lib: Path) -> None:
    """ember_capture_collectives (LOAD's splice) against the stub as "NCCL": every placeholder is
    captured on its own stream capture (thread-local mode), a group as one NCCL group, with the
    calls as recorded; an unknown operation refuses and leaves no graph."""
    out = run_py(CAPTURE, mode="load", env={"LD_PRELOAD": f"{libember}:{stub_lib}"})
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(r["graphs"]) == 3 and all(r["graphs"]) and len(set(r["graphs"])) == 3
    assert len(set(r["shapes"])) == 1  # each holds one memset node here: same shape
    calls = [json.loads(line) for line in r["calls"]]
    assert [c["seq"] for c in calls] == [1, 2, 2, 2, 2, 3]
    assert [c["op"] for c in calls] == ["all_reduce", "send", "send", "recv", "recv", "all_gather"]
    assert calls[0]["count"] == 4096 and calls[-1]["dtype"] == 7 and calls[-1]["count"] == 128
    assert r["driver"][:3] == ["capture:begin:thread-local", "capture:memset", "capture:end"]
    assert r["driver"].count("capture:end") == 4 and r["driver"].count("cuStreamDestroy_v2") == 2
    assert "collective 0" in r["refused"]

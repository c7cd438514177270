"""Union templates through a real LOAD (ArchiveRestore over libember and the stand-in driver).

SAVE (EMBER_UNION_TEMPLATES=1) publishes Llama-like decode chains of several topologies
(`ember_testing.synthetic.synthetic_chains`) with one union template. LOAD then:
- hands the library over with the first needed key on its own exec, then builds ONE template
  exec for all keys (where topology groups would need several);
- switches it to each key: what a launch would run (the stand-in's exec dump: the enabled nodes
  with the parameters the exec holds) is node for node that key's own graph, whatever key the
  exec held before;
- gives every other key its own exec in the background (the Dedicator);
- with EMBER_UNION_TEMPLATES=0, or when the driver refuses the union template, serves the keys
  from their topology groups instead; a member that does not match its slots (a forged archive)
  is never switched in: its own exec serves it.
"""

from __future__ import annotations

import json
from pathlib import Path

SIZES = (1, 2, 4, 8, 16, 32, 48, 64)  # four topologies (ember_testing.synthetic.synthetic_chains)


COMMON = f"""
from ember.archive import graph_table
from ember.archive.graphs import GraphSet, KernelRef
from ember.identity import ArchiveIdentity
from ember.runtime import compat, publish
from ember_testing.synthetic import synthetic_chains
for name in ("standin_execs_alive", "standin_exec_updates", "standin_enable_calls"):
    getattr(cuda, name).restype = ctypes.c_int
for name in ("standin_graph_dump", "standin_exec_dump"):
    getattr(cuda, name).restype = ctypes.c_size_t
    getattr(cuda, name).argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]

ENGINE = "ember-union-test"
STORE = os.environ["TEST_STORE"]
SIZES = tuple(json.loads(os.environ["TEST_SIZES"])) if "TEST_SIZES" in os.environ else {SIZES}
IDENTITY = ArchiveIdentity(model="ember-test/union", engine=ENGINE, engine_version="0", capture_sizes=SIZES)
# the chains' kernels moved into PTX images the stand-in loads (one per synthetic image)
gs = synthetic_chains(sizes=SIZES, layers=3)
names = {{}}
for k in gs.kernels:
    names.setdefault(k.image, []).append(k.name)
entries = {{old: "".join(f".entry {{n}}(\\n)\\n{{{{ ret; }}}}\\n" for n in ns) for old, ns in names.items()}}
ptx = {{old: (".version 8.0\\n.target sm_90\\n" + e).encode() + b"\\0" for old, e in entries.items()}}
new_hash = {{old: ip.hash(data) for old, data in ptx.items()}}
gs = GraphSet(gs.graphs, [KernelRef(new_hash[k.image], k.name) for k in gs.kernels], gs.function_attrs)
images = [publish.Image(new_hash[old], data, "ptx") for old, data in ptx.items()]

def model():
    return [alloc(n) for n in (4096, 3 << 20)]

def window():
    return [alloc(2 << 20), alloc(1 << 20)]

def last_json(obj):
    print(json.dumps(obj))
"""

SAVE = COMMON + """
if os.environ.get("TEST_FORGE") == "1":  # graph 1's QKV GEMM gets another cluster dimension, the
    # union keeps the slots of the true graphs: exec update would keep the old dimension
    from ember.archive import table_encoder, union
    true = [g for g in synthetic_chains(sizes=SIZES, layers=3).graphs]
    table_encoder.union_groups = lambda graphs, fa: union.union_groups(true, fa)
    node = next(n for n in gs.graphs[1].nodes if n.params.attrs)
    node.params.attrs = {4: (3).to_bytes(4, "little").ljust(64, b"\\0")}
model()
ip.capture_begin()
window()
ip.capture_end()
arc = publish.ArchiveContent(IDENTITY, compat.current(ENGINE), graph_table.encode(gs), images,
                             alloc_log=ip.export_alloc_log())
publish.write(STORE, arc, gs)
last_json({"unions": len(graph_table.GraphTable(arc.graph_table).unions)})
"""

LOAD = COMMON + """
from ember.runtime.restore import ArchiveRestore

def dump(fn, handle):
    buf = ctypes.create_string_buffer(1 << 20)
    n = fn(int(handle), buf, len(buf))
    return [line for line in buf.raw[:n].decode().splitlines() if line.startswith("N ")]

restore = ArchiveRestore.open(ip, STORE, IDENTITY.hash(), ENGINE)
model()
ip.replay_window()
lib = restore.library()
first = lib.order[0]
out = {"first_own": lib.own.has(first), "first_launchable": lib.launchable_at(first) is not None}
lib.wait_templates()
out["groups"] = [[len(g.members), g.union is not None] for g in lib.groups]
out["template_execs"] = len(lib._templates)
out["failed"] = lib.failed_templates()
stream = cu.CUstream(0)
same, updates = [], cuda.standin_exec_updates()
for i in [*lib.order, 0, len(SIZES) - 1, 1]:  # every key, then back and forth
    lib.launch_template(i, stream)
    tmpl = lib._templates[lib._group_of[i]]
    same.append(dump(cuda.standin_exec_dump, tmpl.handle) == dump(cuda.standin_graph_dump, lib.graph(i)))
out["same"] = same
out["updates"] = cuda.standin_exec_updates() - updates
out["enable_calls"] = cuda.standin_enable_calls()
if os.environ.get("EMBER_DEDICATE") != "0":
    lib.own.wait(30)
    out["own"] = [lib.own.has(i) for i in range(len(SIZES))]
    out["dedicate_failed"] = lib.own.dedicator.stats.failed
last_json(out)
"""


def _json(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _saved(restore_py, tmp_path: Path, **env: str) -> dict[str, str]:
    store = {"TEST_STORE": (tmp_path / "store").as_uri()}
    saved = _json(restore_py(SAVE, mode="save", env={**store, "EMBER_UNION_TEMPLATES": "1", **env}))
    assert saved["unions"] == 1
    return store


def test_one_union_exec_serves_every_key_as_its_own_graph(restore_py, tmp_path: Path) -> None:
    env = {**_saved(restore_py, tmp_path), "EMBER_DEDICATE": "0"}
    r = _json(restore_py(LOAD, mode="load", env=env))
    assert r["first_own"] and r["first_launchable"]  # handed over on the first key's own exec
    assert r["groups"] == [[len(SIZES), True]] and r["template_execs"] == 1 and r["failed"] == []
    assert r["same"] == [True] * (len(SIZES) + 3)
    assert r["updates"] == len(SIZES) + 3  # one exec update per switch (the exec held no key)
    assert r["enable_calls"] > 0


def test_every_key_gets_its_own_exec_behind_the_union(restore_py, tmp_path: Path) -> None:
    r = _json(restore_py(LOAD, mode="load", env=_saved(restore_py, tmp_path)))
    assert r["same"] == [True] * (len(SIZES) + 3)
    assert r["own"] == [True] * len(SIZES) and r["dedicate_failed"] == []


def test_without_unions_the_topology_groups_serve(restore_py, tmp_path: Path) -> None:
    env = {**_saved(restore_py, tmp_path), "EMBER_DEDICATE": "0", "EMBER_UNION_TEMPLATES": "0"}
    r = _json(restore_py(LOAD, mode="load", env=env))
    assert len(r["groups"]) > 1 and not any(union for _, union in r["groups"])
    assert r["template_execs"] == len(r["groups"]) and r["same"] == [True] * (len(SIZES) + 3)
    assert r["enable_calls"] == 0


def test_a_union_the_driver_refuses_gives_its_members_back_to_their_groups(
    restore_py, tmp_path: Path
) -> None:
    # the union template (63 nodes) is the largest graph (48-51): the stand-in refuses it alone
    env = {**_saved(restore_py, tmp_path), "EMBER_DEDICATE": "0", "STANDIN_FAIL_INSTANTIATE_ABOVE": "60"}
    r = _json(restore_py(LOAD, mode="load", env=env))
    assert r["first_own"] and any("union of" in f for f in r["failed"])
    groups = [g for g in r["groups"] if not g[1]]
    assert sum(n for n, _ in groups) == len(SIZES) and r["template_execs"] == len(groups)
    assert r["same"] == [True] * (len(SIZES) + 3) and r["enable_calls"] == 0


FORGED = LOAD.split("stream = cu.CUstream(0)")[0] + """
stream = cu.CUstream(0)
from ember.archive.table_layout import FormatError
try:
    lib.launch_template(1, stream)
    out["through_union"] = "switched"
except FormatError as exc:
    out["through_union"] = str(exc)
out["own_before"] = lib.own.has(1)
lib.launch(1, stream)  # the engine's path: its own exec, built there and then
out["own"] = lib.own.has(1)
out["others_same"] = []
for i in [0, *range(2, len(SIZES))]:
    lib.launch_template(i, stream)
    tmpl = lib._templates[lib._group_of[i]]
    held = dump(cuda.standin_exec_dump, tmpl.handle)
    out["others_same"].append(held == dump(cuda.standin_graph_dump, lib.graph(i)))
last_json(out)
"""


def test_a_member_that_does_not_match_its_slot_is_never_switched_in(restore_py, tmp_path: Path) -> None:
    env = {**_saved(restore_py, tmp_path, TEST_FORGE="1"), "EMBER_DEDICATE": "0"}
    r = _json(restore_py(FORGED, mode="load", env=env))
    assert r["groups"] == [[len(SIZES), True]] and r["failed"] == []
    assert "does not match its union slot" in r["through_union"]
    assert not r["own_before"] and r["own"] and r["others_same"] == [True] * (len(SIZES) - 1)


REFUSED = LOAD.split("stream = cu.CUstream(0)")[0] + """
stream = cu.CUstream(0)
out["same"] = []
for i in lib.order:  # the engine's path: a switch the driver refuses falls back to the key's own exec
    lib.launch(i, stream)
    held = dump(cuda.standin_exec_dump, lib.exec_for(i))
    out["same"].append(held == dump(cuda.standin_graph_dump, lib.graph(i)))
out["own"] = [lib.own.has(i) for i in range(len(SIZES))]
out["holds"] = lib._templates[0].holds
last_json(out)
"""


def test_a_switch_the_driver_refuses_serves_the_key_from_its_own_exec(restore_py, tmp_path: Path) -> None:
    # the union-shaped graphs (63 nodes) are the largest: the stand-in refuses updates to them
    env = {**_saved(restore_py, tmp_path), "EMBER_DEDICATE": "0", "STANDIN_FAIL_EXEC_UPDATE_ABOVE": "60"}
    r = _json(restore_py(REFUSED, mode="load", env=env))
    assert r["groups"] == [[len(SIZES), True]]
    assert r["own"] == [True] * len(SIZES) and r["same"] == [True] * len(SIZES)
    assert r["holds"] == -1  # the template claims no key after a refused update


PLACEHOLDERS = LOAD.split("stream = cu.CUstream(0)")[0] + """
stream = cu.CUstream(0)
union = lib.groups[0].union
out["scratch_bytes"] = union.info.scratch_bytes
out["same"], out["placeholders"] = [], []
for i in [*lib.order, *lib.order]:  # every key, twice: after a key with the memset and one without
    lib.launch_template(i, stream)
    held = dump(cuda.standin_exec_dump, lib._templates[lib._group_of[i]].handle)
    into_scratch = [line for line in held if line.startswith(f"N 2 {union.scratch} ")]
    own = [line for line in held if line not in into_scratch]
    out["same"].append(own == dump(cuda.standin_graph_dump, lib.graph(i)))
    out["placeholders"].append(len(into_scratch))
out["keys"] = [lib.keys[i][0] for i in [*lib.order, *lib.order]]
out["scratch"] = union.scratch
last_json(out)
"""


def test_a_member_that_lacks_a_memset_runs_a_placeholder_into_scratch(restore_py, tmp_path: Path) -> None:
    """EMBER_UNION_MEMSETS=1: size 24 zeroes a workspace the others do not; all join ONE union
    and the others run that memset's placeholder, writing LOAD's scratch buffer instead."""
    sizes = json.dumps([1, 8, 24, 32, 64])
    env = {**_saved(restore_py, tmp_path, TEST_SIZES=sizes, EMBER_UNION_MEMSETS="1"),
           "EMBER_DEDICATE": "0", "TEST_SIZES": sizes}
    r = _json(restore_py(PLACEHOLDERS, mode="load", env=env))
    assert r["groups"] == [[5, True]] and r["failed"] == []
    assert r["scratch"] and r["scratch_bytes"] == 64 * 24 * 4
    assert r["same"] == [True] * 10  # beside its placeholders, what runs is the key's own graph
    layers = 3
    assert r["placeholders"] == [0 if b == 24 else layers for b in r["keys"]]

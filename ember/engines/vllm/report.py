"""The vLLM plugin's stage report (`EMBER_VLLM_REPORT`), one JSON file per writer.

vLLM's front end and engine core run one after the other and add their stages to the report
file itself. The GPU workers of a parallel shape run at once, so each writes its own file beside
it (`vllm-report.rank1.json`): one rank never overwrites another's stages. `read` puts them back
together and `ranks_restored` says whether every rank of the world restored its graphs, which is
what the sidecar reports as restored (a pod with one rank captured natively is not).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# A pod's data-parallel size (ranks.pod_env). vLLM runs a dense model's DP ranks as engines of
# one replica each (DP 1, args.archived), whose workers are each rank 0 of their own world: their
# files are named by their replica, which vLLM keeps in `data_parallel_index`.
REPLICAS_ENV = "EMBER_VLLM_REPLICAS"


def replica(parallel_config: Any, env: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """(index, count) of this engine among a pod's data-parallel replicas of a dense model; None
    for an engine of the whole world (one GPU, TP, or DP with the ranks in one world: MoE)."""
    text = env.get(REPLICAS_ENV, "").strip()
    count = int(text) if text.isdigit() else 1
    if parallel_config is None or count < 2:
        return None
    if int(getattr(parallel_config, "data_parallel_size", 1) or 1) != 1:  # DP in one world (MoE)
        return None
    index = int(getattr(parallel_config, "data_parallel_index", 0) or 0)
    return (index, count) if 0 <= index < count else None


def worker_rank(replica: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """(rank, world) of this process among the pod's GPU workers once torch.distributed is set up
    and there are more than one of them; None elsewhere (front end, engine core, a single GPU).
    `replica`: this engine's (index, count) among independent DP replicas (`replica`): its ranks
    come after the earlier replicas' ranks."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank, world = int(dist.get_rank()), int(dist.get_world_size())
    index, count = replica or (0, 1)
    if world * count < 2:
        return None
    return index * world + rank, count * world


def rank_path(path: str | Path, rank: int) -> Path:
    path = Path(path)
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def write(path: str | Path, report: dict[str, Any], rank: tuple[int, int] | None) -> None:
    """Merge this process's `report` ({"stages": {...}, other facts}) into its file, atomically."""
    target = Path(path) if rank is None else rank_path(path, rank[0])
    merged = _load(target)
    merged.update({k: v for k, v in report.items() if k != "stages"})
    merged["stages"] = {**(merged.get("stages") or {}), **(report.get("stages") or {})}
    if rank is not None:
        merged["rank"], merged["world"] = rank
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(merged, default=str))
    os.replace(tmp, target)


def read(path: str | Path) -> dict[str, Any]:
    """The report with every rank's file under "ranks" ({"0": {...}, "1": {...}}) when there are any."""
    path = Path(path)
    out = _load(path)
    ranks = {}
    for p in sorted(path.parent.glob(f"{path.stem}.rank*{path.suffix}")):
        one = _load(p)
        if "rank" in one:
            ranks[str(one["rank"])] = one
    if ranks:
        out["ranks"] = ranks
    return out


def clear(path: str | Path) -> None:
    """A previous start's report and rank files, gone."""
    path = Path(path)
    path.unlink(missing_ok=True)
    for p in path.parent.glob(f"{path.stem}.rank*{path.suffix}"):
        p.unlink(missing_ok=True)


def ranks_restored(report: dict[str, Any]) -> bool:
    """Did every GPU worker restore? One GPU: the report's own capture stage; a world of N: N rank
    files, each with a restored capture."""
    ranks = report.get("ranks") or {}
    if not ranks:
        return _restored(report)
    worlds = {int(r.get("world") or 0) for r in ranks.values()}
    return len(worlds) == 1 and len(ranks) == worlds.pop() and all(_restored(r) for r in ranks.values())


def verify_cost(one: dict[str, Any]) -> dict[str, Any]:
    """LOAD's canary of one writer's report (a rank's file, or a one-GPU report): its verdict,
    milliseconds and parts ({} when no canary ran: native capture, or refused before it)."""
    v = (one.get("stages") or {}).get("verify") or {}
    if not v:
        return {}
    return {"ok": v.get("ok"), "verify_ms": v.get("verify_ms"), "parts_ms": v.get("parts_ms") or {},
            "checked": v.get("checked") or [], "why": v.get("why") or "", "pieces": v.get("pieces") or {},
            "kv": v.get("kv") or []}


def _restored(one: dict[str, Any]) -> bool:
    return bool(((one.get("stages") or {}).get("capture") or {}).get("how") == "restored")


def _load(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}

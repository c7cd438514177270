"""SAVE's proof again with less when it fails, cheapest loss first (torch-free, so it is tested
without a GPU). Union templates go first: they are an optimisation of the serving path, and the
topology groups serve the same graphs. Cut kernel images go second: dropping them costs every
LOAD the whole images (a 4.7 MB Llama-shape archive becomes 31 MB). Neither is expected to fail
(each member and each cut kernel is checked before), so a fallback that is taken is reported:
`ProofReport.unions_dropped`, and the log line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Proven = tuple[Any, bytes, Any]  # (ProofReport, graph table blob, GraphLibrary)


def prove_falling_back(
    prove: Callable[[bool | None], Proven],
    images_cut: bool,
    undo_cut: Callable[[], None],
    log: Callable[[str], None],
) -> tuple[Any, bytes, Any, bool]:
    """`prove(unions)` (None: the default, False: no union templates) until it passes or nothing
    is left to drop: without unions, then with the whole images and unions, then without either.
    Returns the last proof and whether the kernel images are still cut."""
    rep, blob, lib = prove(None)
    if _unions_may_be_why(rep):
        rep, blob, lib = _without_unions(prove, rep, lib, log)
    if not rep.ok and images_cut:
        log("[ember] the proof failed with the cut kernel images; proving with the whole images")
        lib.close()
        undo_cut()
        images_cut = False
        rep, blob, lib = prove(None)
        if _unions_may_be_why(rep):
            rep, blob, lib = _without_unions(prove, rep, lib, log)
    return rep, blob, lib, images_cut


def _unions_may_be_why(rep: Any) -> bool:
    """A failed proof with union templates, every graph's own (dedicated) exec right: only the
    template path failed, which unions change. A wrong dedicated exec is wrong without them too,
    and a proof of many graphs can take minutes."""
    return not rep.ok and bool(rep.unions) and rep.dedicated_ok == rep.graphs


def _without_unions(prove: Callable[[bool | None], Proven], failed: Any, lib: Any,
                    log: Callable[[str], None]) -> Proven:
    why = "; ".join(failed.mismatches[:2])[:500]
    log(f"[ember] the proof failed with union templates ({why}); proving without them")
    lib.close()
    rep, blob, new = prove(False)
    rep.unions_dropped = why
    return rep, blob, new

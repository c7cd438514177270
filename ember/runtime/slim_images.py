"""SAVE: the graphs' kernel images cut down to this GPU's cubin and the kernels the graphs use.

The driver's load time follows the size of the cubin it loads, and a framework's fatbin holds
every architecture and every kernel of its source file: the Llama-3-8B decode graphs run 1-4 of
the 30-500 kernels in each of torch's fatbins. `slim` replaces each such image, before the proof,
with `ember.archive.kernel_images`' cut of it (registered with libember under its own content
hash) and points the graph set's kernel references at it. The proof then rebuilds and replays
the graphs with the cut images' functions, so an archive is only published if they compute
bit-identical results; `save` falls back to the whole images if that proof fails.

An image is kept whole when cutting it fails, saves nothing, or changes any of its kernels'
attributes (registers, shared/const/local memory, block limits, versions, cluster rules).
EMBER_SLIM_IMAGES=0 turns this off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cuda.bindings import driver as cu

from ember import settings
from ember.archive import kernel_images
from ember.archive.graphs import GraphSet, KernelRef
from ember.native import EmberError, Interposer

# CU_FUNC_ATTRIBUTE_* 0..16: what a launch or an occupancy calculation depends on
_ATTRS = [cu.CUfunction_attribute(a) for a in range(17)]


@dataclass
class SlimReport:
    images: int = 0  # images cut
    bytes_before: int = 0
    bytes_after: int = 0
    kept_whole: dict[str, str] = field(default_factory=dict)  # image -> why it was not cut
    replaced: dict[str, str] = field(default_factory=dict)  # original image -> cut image

    def facts(self) -> dict[str, object]:
        return {
            "images_cut": self.images,
            "image_bytes_whole": self.bytes_before,
            "image_bytes_cut": self.bytes_after,
            "images_kept_whole": len(self.kept_whole),
        }


def enabled() -> bool:
    return settings.on("EMBER_SLIM_IMAGES")


def function_attrs(func: int) -> list[int]:
    out = []
    for a in _ATTRS:
        err, v = cu.cuFuncGetAttribute(a, cu.CUfunction(func))
        out.append(int(v) if err == cu.CUresult.CUDA_SUCCESS else -1)
    return out


def slim(
    ip: Interposer,
    graph_set: GraphSet,
    arch: int,
    log: Callable[[str], None] = print,
    attrs: Callable[[int], list[int]] = function_attrs,
) -> SlimReport:
    """Cut every image the graph set uses; `graph_set.kernels` then refers to the cut images."""
    rep = SlimReport()
    names: dict[str, set[str]] = {}
    for k in graph_set.kernels:
        names.setdefault(k.image, set()).add(k.name)
    options = {
        e["hash"]: {"jit": e.get("jit_options", {}), "library": e.get("library_options", {})}
        for e in ip.catalog()
    }
    for image, wanted in names.items():
        try:
            data = ip.image_bytes(image)
            cubin = kernel_images.fatbin_cubin(data, arch) if kernel_images.is_fatbin(data) else data
            if cubin is None or not kernel_images.is_cubin(cubin):
                rep.kept_whole[image] = f"no single sm_{arch} cubin in it"
                continue
            cut = kernel_images.prune(cubin, wanted)
            if len(cut) >= len(cubin):
                continue  # a cubin of only the kernels used already
            new = ip.hash(cut)
            ip.preload([(new, cut, options.get(image, {}))])
            for name in sorted(wanted):
                if attrs(ip.function(new, name)) != attrs(ip.function(image, name)):
                    raise kernel_images.ImageFormatError(f"{name}: its attributes differ once cut")
        except (kernel_images.ImageFormatError, EmberError) as e:
            rep.kept_whole[image] = str(e)[:200]
            continue
        rep.replaced[image] = new
        rep.images += 1
        rep.bytes_before += len(data)
        rep.bytes_after += len(cut)
    graph_set.kernels = [KernelRef(rep.replaced.get(k.image, k.image), k.name) for k in graph_set.kernels]
    for image, why in list(rep.kept_whole.items())[:5]:
        log(f"[ember] kernel image {image[:12]} kept whole: {why}")
    return rep


def undo(graph_set: GraphSet, rep: SlimReport) -> None:
    """Point the graph set back at the whole images."""
    back = {new: old for old, new in rep.replaced.items()}
    graph_set.kernels = [KernelRef(back.get(k.image, k.image), k.name) for k in graph_set.kernels]

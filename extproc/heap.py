"""The garbage collector kept off the decision path.

A worker's heap is mostly what it built at start and keeps: the modules, the configuration snapshot,
the compiled policy, gRPC's and aiohttp's machinery - about 90,000 tracked objects, which a full
(generation 2) collection walks every time: 50 ms on this project's 2-core machine when it is idle,
and, on a loaded machine, perhaps more than Envoy's 1 s ext_proc message timeout: the suite on
three workers saw decisions right after a worker's start stall that long and be refused 503, and
none once the heap was frozen (not profiled: docs/ARCHITECTURE.md, "Fail closed, twice"). CPython
runs that collection in whatever code allocates next, here a decision. So once the heap is built,
and again after each reload, it is collected and frozen (`gc.freeze`): later collections walk only
what came after.
"""

from __future__ import annotations

import gc


def settle() -> None:
    """Collect what is garbage now, then move every object alive now out of the collector's reach. A
    reload calls it again: the previous snapshot, frozen with the rest, is released first."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()

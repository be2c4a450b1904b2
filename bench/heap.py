"""The benchmark processes' Python heap between waves (the load generator's,
and an in-process target's).

`settle_heap()` runs off the clock, before a wave or scenario starts: a full
collection, then everything still alive (the records of the waves so far,
the imports, a loaded model) frozen out of the cyclic collector's sight, so
a collection during the wave walks only that wave's objects. Unfrozen, the
load generator's heap cost 26-28 ms a full collection on the 2-core CPU, a
gap in every stream it was reading when one came mid-wave, and an in-process
target's a stalled step. mlxd's own processes freeze theirs once they are
ready (worker/proc.py, gateway/workers/served_model.py); the peer is run as
it ships.

Threading: call it from the process's only benchmark thread, between waves.
"""

from __future__ import annotations

import gc


def settle_heap() -> None:
    gc.collect()
    gc.freeze()

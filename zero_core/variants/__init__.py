"""The systems beyond the paper, each a ZeRO stage of `zero_core.stages` with one thing changed.

What they change, and why a course on ZeRO shows them:
- `offload.py`: ZeRO-Offload, ZeRO-2 with the optimizer states and step on the host (memory for PCIe);
- `hsdp.py`: HSDP / MiCS, ZeRO-3 inside each node and data parallelism across nodes (memory for slow links);
- `hpz.py`, `qwz.py`, `qgz.py`, `zeropp.py`: ZeRO++, its three ways to take bytes off the inter-node links
  (a node's copy of the weights, int8 weight gathers, int4 gradient all-to-alls) and all three together;
- `nodes.py`: the node and replica process groups those stages build their collectives on;
- the exercises' stages, each the paper's with one piece a student writes: `bucketed.py` (ZeRO-2's
  gradients in buckets, ex06), `prefetching.py` (ZeRO-3's gathers k layers ahead, ex07), `accumulating.py`
  (ZeRO-2 with accumulation and global-norm clipping, ex08), `hierarchical.py` (ZeRO-3's gathers in two
  levels, ex09).

The modules are imported when named, not with the package; `zero_core.registry` finds the ones `compare`
runs by name ("offload", "hsdp", "hpz", "qwz", "qgz", "zeropp").
"""

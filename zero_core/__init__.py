"""zero_core: a byte-counting virtual GPU cluster and reference ZeRO-0/1/2/3 (arXiv:1910.02054)."""

from zero_core.cluster import VirtualCluster

__all__ = ["VirtualCluster"]

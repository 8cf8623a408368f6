"""Emulate an N-node cluster on one Linux machine: network namespaces, a bridge, shaped links.

    sudo python launch/cluster.py --nodes 4 --rate 1gbit --delay 0.5ms -- \\
        python launch/pretrain.py --deepspeed_config ds_configs/scape_dct.json --train-iters 50
    sudo python launch/cluster.py --nodes 2 --rate 10gbit --ranks-per-node 2 -- python my_script.py
    sudo python launch/cluster.py --nodes 4 --rate 1gbit --mpi -- python my_mpi_script.py  # ranks from mpiexec
    sudo python launch/cluster.py --cleanup-stale        # remove namespaces left by a killed run

How the nodes, links and MPI launch work, and what is cleaned up: scape_ds/cluster.py
(``scape_ds.cluster.Cluster`` for use from Python). Needs root; without it, it says so and exits 2.
"""
import sys

from scape_ds.cluster import main

if __name__ == "__main__":
    sys.exit(main())

"""How the world is cut: process groups and the parallel layout.

Owns the launch's process group and rank facts (:mod:`.distributed`: init, barriers, rank, world size, the
launcher's variables), the data x sequence x tensor layout and every rule about it (:mod:`.layout`:
divisibility, ZeRO stage compatibility, which rank holds which shard), sequence parallelism (DeepSpeed
Ulysses: batch sharding, attention wiring), tensor parallelism (DeepSpeed AutoTP checks) and the DeepSpeed op builds
the process group's start waits for (:mod:`.op_builds`: their folder, a lock a killed build left behind). What it changes in
DeepSpeed or transformers goes through :mod:`finetune.patches`. It may import the run config, logging, patches
and errors, nothing above them.
"""

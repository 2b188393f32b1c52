"""Hierarchical exchange: dense inside a host, sparse only across hosts.

GPU hosts join their 4-8 GPUs by links tens of times faster than the network between hosts;
compressing traffic that stays inside a host only costs selection time. With L ranks per host
and N hosts, per sparse bucket and step (``hierarchical=True``):

1. a dense reduce-scatter among the L ranks of a host: local rank l then holds shard l of the
   bucket (Horovod's split: the first ``n mod L`` shards one element longer), summed over its host;
2. error feedback and Top-K on that shard: ``residual += host sum of shard``, select at
   ``L x density`` (so each rank still sends density x n pairs, as flat, and a host as many as
   its L ranks would), zero what was sent. **The residual is per rank and covers only its
   shard of the host's sum**;
3. the sparse exchange (allgather or sparse allreduce) of shard l among the N ranks with local
   rank l, one per host, each carrying 1/L of the bucket;
4. an allgather inside the host of the L shards' exchanged pairs (still compressed), which
   every rank decodes, so every rank holds the whole averaged result.

Horovod needs the host and cross-host groups as process sets, registered on every rank in the
same order: ``hvd_topk.init()`` (instead of ``hvd.init()``, same arguments) does that, with
Horovod's dynamic process sets. Horovod's own ``hvd.local_rank()`` / ``hvd.cross_rank()`` say
which rank is on which host (the launcher's view: one ``orted``/``horovodrun`` host per node).
"""

import os
import warnings
from typing import NamedTuple

from hvd_topk._horovod import hvd


class Topology(NamedTuple):
    """This rank's place: its host's process set and its cross-host one."""
    local: object        # hvd.ProcessSet: the ranks of this host (None where hosts are uneven)
    cross: object        # hvd.ProcessSet: the ranks with this local rank, one per host (ditto)
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    local_sizes: tuple   # every rank's hvd.local_size(), in rank order: the same on every rank

    @property
    def uneven(self):
        return uneven_hosts(self.local_sizes)


def uneven_hosts(local_sizes):
    """Hosts with different numbers of ranks (``local_sizes``: every rank's local size): their
    shards would not line up across hosts (local rank l's shard is 1/L of the bucket, and L
    differs), so there is no hierarchy."""
    return len(set(local_sizes)) > 1


_topology = None

# Why hierarchical="auto" stays flat under an inner optimizer that exchanges each rank's update
# (LocalAdamW, DeMo: the engine's ``updates``), and what hierarchical=True over one warns: the
# AdamW recipe at 8 ranks on 2 emulated hosts of 4 (GPT example, 1000 steps, the allgather,
# benchmarks/results/gpt/convergence-gpt-np8-hierarchical-seed42-1000.md, -seed43-, -seed44-) ended
# 6.2% above the flat runs over seeds 42-44 (+5.9%, +4.6%, +8.1%); DeMo over it is not measured.
UPDATES_COST = ("hvd_topk: hierarchical=True over an inner optimizer that exchanges each rank's update (LocalAdamW, "
                "DeMo): the AdamW recipe on 2 hosts of 4 ranks ended 6.2% above the flat exchange (3 seeds, 4.6% to 8.1%; "
                "docs/exchanges.md, hierarchical exchange); hierarchical='auto' leaves it off for these optimizers.")


def init(*args, **kwargs):
    """``hvd.init(*args, **kwargs)``, then the process sets ``hierarchical=`` needs.

    Call it on every rank instead of ``hvd.init()``. It turns on Horovod's dynamic process sets
    (``HOROVOD_DYNAMIC_PROCESS_SETS=1``, read by ``hvd.init``) and adds one set per host and
    one per local rank, in the same order everywhere (a collective). Returns the ``Topology``.

    Where hosts have different numbers of ranks it adds no sets (``hierarchical=True`` then
    says why it cannot run; "auto" stays flat). Call it once, instead of ``hvd.init()``: Horovod
    reads ``HOROVOD_DYNAMIC_PROCESS_SETS`` only when it starts.

    Horovod refuses a second process set of the same ranks. A set passed in ``process_sets=``
    whose ranks are a host's (or a local rank's across hosts) is used as that set; one wanted
    later is ``Topology.local`` / ``Topology.cross`` (``hvd.add_process_set`` of the same ranks
    raises).
    """
    global _topology
    if hvd.is_initialized():
        raise RuntimeError(
            "hvd_topk.init() starts Horovod itself (with dynamic process sets, which Horovod reads "
            "only at start-up), but Horovod is already initialized: call hvd_topk.init() instead of "
            "hvd.init(), once" + (" (it was called before)" if _topology is not None else ""))
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    hvd.init(*args, **kwargs)
    given = kwargs.get("process_sets", args[1] if len(args) > 1 else None)
    given = [] if given is None or isinstance(given, str) else list(given)
    # Horovod's cross rank is a rank among those with the same local rank, which names the
    # host only where every host has the same number of ranks
    places = hvd.allgather_object((hvd.cross_rank(), hvd.local_rank(), hvd.local_size()),
                                  name="hvd_topk.topology")
    local_sizes = tuple(size for _, _, size in places)
    if uneven_hosts(local_sizes):
        _topology = Topology(None, None, hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
                             hvd.cross_size(), local_sizes)
        return _topology
    hosts = sorted({c for c, _, _ in places})
    locals_ = sorted({lr for _, lr, _ in places})
    mine = places[hvd.rank()]
    local_sets, cross_sets = {}, {}
    for c in hosts:  # every rank adds every set, in this order
        local_sets[c] = _add([r for r, (cr, _, _) in enumerate(places) if cr == c], given)
    for lr in locals_:
        cross_sets[lr] = _add([r for r, (_, l, _) in enumerate(places) if l == lr], given)
    local, cross = local_sets[mine[0]], cross_sets[mine[1]]
    _topology = Topology(local, cross, local.rank(), local.size(), cross.rank(), cross.size(), local_sizes)
    return _topology


def _add(ranks, given):
    """The process set of ``ranks``: the global one, one of the user's ``given`` sets (passed to
    ``init``: Horovod refuses a duplicate), or a new one."""
    if len(ranks) == hvd.size():
        return hvd.global_process_set
    for process_set in given:
        if process_set.ranks is not None and sorted(process_set.ranks) == ranks:
            return process_set
    return hvd.add_process_set(ranks)


def resolve(setting, process_set, elastic):
    """The topology to use for ``hierarchical=setting`` ("auto", True or False), or None.

    "auto": on when ``init()`` made the sets, the job has more than one host and the same number
    of ranks, more than one, on every host, exchanges run over the global set and the job is
    not elastic. True: on wherever it can be, and a ValueError saying why where it cannot.
    Every rank answers alike: each condition reads what every rank sees the same."""
    if setting is False:
        return None
    topo = _topology
    why = None
    if topo is None:
        why = ("hvd_topk.init() was not called: it creates the host and cross-host process sets "
               "(call it instead of hvd.init(), same arguments)")
    elif process_set is not hvd.global_process_set and process_set.size() != hvd.size():
        why = "the optimizer exchanges over a process set; hierarchical needs the whole job"
    elif elastic:
        why = "Horovod elastic re-forms the job, and these process sets with it"
    elif topo.uneven:
        sizes = sorted(set(topo.local_sizes), reverse=True)
        why = (f"the hosts have different numbers of ranks ({' or '.join(map(str, sizes))}, from "
               "hvd.local_size()): each rank's shard of a bucket is 1/(ranks per host) of it, so the "
               "shards exchanged across hosts would not line up")
    if setting is True:
        if why:
            raise ValueError(f"hierarchical=True: {why}")
        if topo.cross_size == 1 and topo.local_size > 1:
            warnings.warn("hvd_topk: hierarchical=True on a single host: each step's dense reduce-scatter among "
                          "its ranks sends more than the flat sparse exchange would (it is built for several "
                          "hosts, where only the links between them carry pairs); the default 'auto' leaves "
                          "it off here.")
        return topo
    if why is None and topo.local_size > 1 and topo.cross_size > 1:
        return topo
    if why is not None and ((topo is None and _multi_host_guess()) or (topo is not None and topo.uneven)):
        warnings.warn(f"hvd_topk: hierarchical exchange is off: {why}.")
    return None


def _multi_host_guess():
    return 1 < hvd.local_size() < hvd.size()


def reduce_scatter(tensor, process_set, name):
    """Start the host's sum of ``tensor`` split into its shards (Horovod's reducescatter)."""
    return hvd.reducescatter_async(tensor, name=name, op=hvd.Sum, process_set=process_set)


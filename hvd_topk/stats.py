"""Counters that users, examples and benchmarks read: what was sent, what it replaced."""

import threading

# The "dense fp32" every ratio is against: 4 bytes an element whatever the parameters' dtype (a
# bf16 model's dense allreduce travels as fp32 through Horovod too, hvd_topk._horovod.allreduce_dtype)
DENSE_FP32_BYTES = 4


class CompressionStats:
    """Thread-safe running totals (backward hooks may run on autograd's device threads)."""

    _FIELDS = (
        "tensors_sparse",     # tensors sent as (value, index) pairs
        "tensors_dense",      # tensors sent by dense allreduce
        "elements_total",     # elements in all tensors handled
        "elements_selected",  # elements chosen by top-k
        "bytes_dense",        # bytes of the same tensors in fp32 (DENSE_FP32_BYTES each): "dense fp32"
        "bytes_sent",         # bytes this rank actually handed to Horovod, whatever the dtype
        "bytes_host",         # of those, handed to collectives inside a host (the hierarchical exchange)
        "nonfinite_resets",   # residuals reset because they held inf/nan
        "selection_repasses", # extra passes the native kernel made (threshold estimated too high)
        "selection_filled",   # entries 'sampled' filled a shortfall with (<= 5% of k each, zeros aside)
    )
    _TIMERS = (
        "time_selection_s",    # selecting (and packing) what to send
        "time_exchange_s",     # waiting on and decoding exchanges in synchronize(), other than selecting
        # parts of time_exchange_s with the hierarchical exchange (hvd_topk.hierarchy):
        "time_host_reduce_s",  # waiting for the host's dense reduce-scatter in synchronize()
        "time_cross_s",        # the sparse exchange of this rank's shard across hosts
        "time_host_gather_s",  # the allgather of the exchanged shards among the host's ranks
    )

    # What a checkpoint carries (``carried``, ``carry``), so that the statistics of a resumed run
    # cover the whole run (its dense start included), not the job since the resume: the counts,
    # the same bits in the same run. The timers are this process's own.
    CARRIED = ("steps",) + _FIELDS

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self):
        with self._lock:
            self._values = {name: 0 for name in self._FIELDS}
            self._values.update({name: 0.0 for name in self._TIMERS})
            self._values["steps"] = 0
            self._tensors = {}

    def add(self, **amounts):
        with self._lock:
            for name, amount in amounts.items():
                if name not in self._values:
                    raise KeyError(f"unknown statistic {name!r}")
                self._values[name] += amount

    def add_tensor(self, name, amount):
        """Add a 0-d device tensor without reading it (no host synchronisation on the hot
        path); it is read when statistics are asked for."""
        if name not in self._values:
            raise KeyError(f"unknown statistic {name!r}")
        with self._lock:
            self._tensors[name] = amount if name not in self._tensors else self._tensors[name] + amount

    def carried(self):
        """The counts (``CARRIED``) as Python ints, for a checkpoint."""
        out = self.as_dict()
        return {name: int(out[name]) for name in self.CARRIED}

    def carry(self, counts):
        """Take a checkpoint's counts (``carried``'s output, checked by
        ``hvd_topk.checkpoint.stats_problem``) as this object's own; the timers go on."""
        with self._lock:
            for name, amount in self.known(counts).items():
                self._values[name] = int(amount)
                self._tensors.pop(name, None)

    @classmethod
    def known(cls, counts):
        """The counts of ``counts`` that this version keeps (``CARRIED``): a later version's others
        are left out."""
        return {name: amount for name, amount in counts.items() if name in cls.CARRIED}

    def __getstate__(self):
        """Pickled and deep-copied without the lock (a lock cannot be): the DDP hook's state is
        copied with the model (``copy.deepcopy(ddp_model)``, ``AveragedModel``) and pickled by
        Lightning's spawn launcher."""
        with self._lock:
            return {"_values": dict(self._values), "_tensors": dict(self._tensors)}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def as_dict(self):
        """A snapshot with derived ratios: ``density`` achieved and ``bytes_ratio`` sent/dense."""
        with self._lock:
            out = dict(self._values)
            for name, amount in self._tensors.items():
                out[name] += int(amount)
        out["density"] = out["elements_selected"] / out["elements_total"] if out["elements_total"] else 0.0
        out["bytes_ratio"] = out["bytes_sent"] / out["bytes_dense"] if out["bytes_dense"] else 0.0
        return out

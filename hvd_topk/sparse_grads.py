"""Sparse gradients (``nn.Embedding(sparse=True)``): densified, compressed, handed back sparse.

Horovod exchanges a sparse gradient as an allgather of every rank's touched rows (or, with
``sparse_as_dense=True``, as a dense allreduce). hvd_topk always takes the second road, with
Top-K and error feedback on the densified gradient: its bytes are then the fixed Top-K
budget, where the allgather's grow with the batch and the ranks, and the embedding's unsent
entries are kept like any other's. ``synchronize()`` hands the result back sparse, as Horovod
does, so a sparse optimizer (``torch.optim.SparseAdam``) works unchanged. Without
``sparse_as_dense=True`` one warning says so (docs/compatibility.md#sparse-gradients).
"""

import warnings

import torch

from hvd_topk._stack import outside_level


class SparseGradients:
    """The parameters whose gradient is handed back sparse.

    Every parameter whose gradient ever arrived sparse on this rank, not only this step's: a
    rank that did not touch an embedding this step has no gradient of it (its hook never
    fires), and the exchange writes the average into a dense ``p.grad``; handed over dense on
    that rank alone, SparseAdam (and SGD's sparse momentum) raised there and the job died.
    """

    def __init__(self, names, sparse_as_dense):
        self.names = names
        self.warned = sparse_as_dense  # passing the option is saying it: no warning then
        # id(p) -> (p, the sparse dimensions its gradient arrived with: nn.Embedding's 1, rows
        # with their whole vectors, as Horovod hands them back; 1 until one has arrived), every
        # parameter handed back sparse
        self.sparse = {}

    def always(self, params):
        """Hand ``params``' gradients back sparse from the first step (a SparseAdam's, which
        takes nothing else), before this rank has seen one of their sparse gradients."""
        for p in params:
            self.sparse.setdefault(id(p), (p, 1))

    def held_sparse(self, optimizer_state):
        """Hand back sparse the gradients of the parameters whose optimizer state holds a sparse
        tensor (SGD's momentum after a sparse gradient): a dense gradient added to it raises. A
        checkpoint carries that state but not which gradients arrived sparse on this rank, so a
        new optimizer loading it learns it here (a rank leaving the embedding out of its first
        step after a resume was handed a dense gradient, and SGD raised there)."""
        for p, state in optimizer_state.items():
            held = [v for v in state.values() if torch.is_tensor(v) and v.is_sparse]
            if held:
                self.sparse.setdefault(id(p), (p, held[0].sparse_dim()))

    def densify(self, p):
        """Replace ``p.grad`` (sparse) by its dense form, to be exchanged like any gradient."""
        if not self.warned:
            self.warned = True
            warnings.warn(f"hvd_topk: parameter {self.names[p]!r} has a sparse gradient (e.g. "
                          "nn.Embedding(sparse=True)); it is exchanged as with sparse_as_dense=True: "
                          "densified, compressed by Top-K with error feedback, and handed back sparse. "
                          "Pass sparse_as_dense=True to hvd_topk.DistributedOptimizer to say so and "
                          "silence this warning.", stacklevel=outside_level())
        self.sparse[id(p)] = (p, p.grad.sparse_dim())
        p.grad = p.grad.to_dense()

    def restore(self):
        """After the exchange: the gradients of every parameter in ``sparse`` back to sparse, as
        Horovod hands them over (those this rank did not touch too: the exchange wrote them)."""
        for p, sparse_dim in self.sparse.values():
            if p.grad is not None and p.grad.layout == torch.strided:
                p.grad = p.grad.to_sparse(min(sparse_dim, p.grad.dim()))

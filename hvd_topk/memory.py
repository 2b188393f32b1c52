"""Error feedback: what each parameter did not send yet, and DGC momentum correction.

Per parameter and step, without momentum correction::

    acc = residual + grad;  send top-k of acc;  residual = acc with the sent entries zeroed

With momentum correction ``m`` (DGC): ``u = m * u + grad; v = v + u``; send top-k of ``v``;
zero the sent entries of ``v`` and of ``u`` (momentum factor masking). The inner optimizer
should then run without momentum of its own.

Everything is done in place in buffers that live as long as the optimizer, with no host
synchronisation: a non-finite accumulator is detected as a 0-d tensor flag and wiped with
``masked_fill_``, so it never survives into the next step.
"""

import torch


class ErrorFeedback:
    def __init__(self, momentum=0.0):
        if not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"momentum_correction must be in [0, 1), got {momentum!r}")
        self.momentum = float(momentum)
        self.residuals = {}   # name -> tensor shaped like the gradient (v in DGC)
        self.momenta = {}     # name -> tensor (u in DGC), only with momentum correction
        self._nonfinite = None  # 0-d counter tensor, read only when statistics are asked for
        self._nonfinite_host = 0  # the same, counted where the flag was already on the host

    def accumulator(self, name, grad):
        """The parameter's accumulator (created as zeros on first use), without updating it:
        for the native kernel, which folds ``grad`` in during its selection pass."""
        acc = self.residuals.get(name)
        if acc is None:
            acc = self.residuals[name] = torch.zeros_like(grad, memory_format=torch.contiguous_format)
        return acc

    def compensate(self, name, grad):
        """Fold ``grad`` into the parameter's accumulator and return it (a persistent buffer)."""
        acc = self.accumulator(name, grad)
        if self.momentum:
            u = self.momenta.get(name)
            if u is None:
                u = self.momenta[name] = torch.zeros_like(acc)
            u.mul_(self.momentum).add_(grad)
            acc.add_(u)
        else:
            acc.add_(grad)
        return acc

    def sent(self, name, flat_indices):
        """Zero what was sent; wipe the whole state if it held inf/nan. Returns the 0-d flag."""
        acc = self.residuals[name]
        bad = ~torch.isfinite(acc).all()
        acc.view(-1).index_fill_(0, flat_indices, 0)
        acc.masked_fill_(bad, 0)
        u = self.momenta.get(name)
        if u is not None:
            u.view(-1).index_fill_(0, flat_indices, 0)
            u.masked_fill_(bad, 0)
        self._count(bad)
        return bad

    def sent_native(self, name, flat_indices, nonfinite):
        """After the native kernel zeroed the sent entries of the accumulator: zero them in the
        momentum too, and wipe both if the kernel saw inf/nan (a host bool on CPU)."""
        u = self.momenta.get(name)
        if u is not None:
            u.view(-1).index_fill_(0, flat_indices, 0)
        if nonfinite:
            self.residuals[name].zero_()
            if u is not None:
                u.zero_()
            self._nonfinite_host += 1

    def flush(self, name):
        """Everything was sent (dense step): the accumulator starts again from zero."""
        acc = self.residuals.get(name)
        if acc is not None:
            self._count(~torch.isfinite(acc).all())
            acc.zero_()
        u = self.momenta.get(name)
        if u is not None:
            u.zero_()

    def _count(self, bad):
        self._nonfinite = bad.long() if self._nonfinite is None else self._nonfinite.add_(bad.long())

    def nonfinite_resets(self):
        return self._nonfinite_host + (0 if self._nonfinite is None else int(self._nonfinite.item()))

    def state_dict(self):
        return {"residuals": dict(self.residuals), "momenta": dict(self.momenta)}

    def load_state_dict(self, state, device_of):
        """Copy saved buffers; ``device_of(name)`` says where the parameter lives now."""
        self.residuals = {n: t.detach().to(device_of(n)).clone() for n, t in state["residuals"].items()}
        self.momenta = {n: t.detach().to(device_of(n)).clone() for n, t in state["momenta"].items()}

    def clear(self):
        self.residuals.clear()
        self.momenta.clear()

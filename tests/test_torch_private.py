"""hvd_topk/_torch.py (what hvd_topk needs from PyTorch beyond its documented API), single
process: compiled autograd detection, copy_all with and without torch._foreach_copy_, the
record of a tensor left unchanged."""

import pytest
import torch


def test_compiled_autograd_detected():
    import torch._dynamo

    from hvd_topk._torch import compiled_autograd_active

    assert not compiled_autograd_active()
    torch._dynamo.config.compiled_autograd = True
    try:
        assert compiled_autograd_active()
    finally:
        torch._dynamo.config.compiled_autograd = False
    assert not compiled_autograd_active()


@pytest.mark.parametrize("foreach", [True, False])
def test_copy_all_copies_each_pair_with_or_without_foreach(foreach, monkeypatch):
    """``_torch.copy_all``: every destination takes its source (a channels_last one in its own
    layout, a float64 source converted), through torch's foreach call or the loop."""
    from hvd_topk import _torch
    if not foreach:
        monkeypatch.delattr(torch, "_foreach_copy_", raising=False)
    dests = [torch.zeros(3), torch.zeros(2, 3, 2, 2).contiguous(memory_format=torch.channels_last)]
    srcs = [torch.tensor([1.5, -2.0, 3.0], dtype=torch.float64), torch.arange(24.0).view(2, 3, 2, 2)]
    _torch.copy_all(dests, srcs)
    assert dests[0].tolist() == [1.5, -2.0, 3.0] and dests[0].dtype == torch.float32
    assert torch.equal(dests[1], srcs[1]) and dests[1].is_contiguous(memory_format=torch.channels_last)


def test_still_written_sees_in_place_changes_and_replacements():
    """``_torch.written`` / ``still_written``: the same tensor untouched since counts as still
    written; an in-place change (a backward accumulating into it, ``zero_()``), or another
    tensor in its place, does not."""
    from hvd_topk._torch import still_written, written

    grad = torch.ones(4)
    record = written(grad)
    assert still_written(record, grad)
    assert not still_written(record, torch.ones(4))  # equal values, another tensor
    grad.add_(1.0)
    assert not still_written(record, grad)
    record = written(grad)
    grad.zero_()
    assert not still_written(record, grad)


def test_after_backward_runs_after_the_backwards_own_final_callbacks():
    """``_torch.after_backward``: queued from inside a backward (a gradient hook), the function
    runs once, after the backward's final callbacks queued before it and those they queue (DDP's
    reducer writes p.grad in one), and before ``backward()`` returns; outside a backward, never."""
    from hvd_topk._torch import after_backward

    engine = torch.autograd.Variable._execution_engine
    order = []
    x = torch.ones(3, requires_grad=True)

    def hook(grad):
        engine.queue_callback(lambda: order.append("queued before"))  # as DDP's reducer
        after_backward(lambda: order.append("after_backward"))
        engine.queue_callback(lambda: order.append("queued after"))
        return grad

    x.register_hook(hook)
    (x * 2).sum().backward()
    assert order == ["queued before", "queued after", "after_backward"], order
    after_backward(lambda: order.append("outside"))
    assert order[-1] == "after_backward", order

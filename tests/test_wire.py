"""hvd_topk/wire.py: the packed (values, indices) layout, single process: round trips over
ranks, a mismatched gather refused, the index dtype by tensor size."""

import pytest
import torch

from hvd_topk import wire


@pytest.mark.parametrize("value_dtype,index_dtype,count", [
    (torch.float32, torch.int32, 7), (torch.float16, torch.int32, 5), (torch.float64, torch.int32, 3),
    (torch.bfloat16, torch.int64, 9), (torch.float32, torch.int64, 1)])
def test_wire_roundtrip_over_ranks(value_dtype, index_dtype, count):
    layout = wire.Layout(count, value_dtype, index_dtype)
    assert layout.nbytes % 8 == 0
    assert layout.nbytes >= count * (torch.empty((), dtype=value_dtype).element_size()
                                     + torch.empty((), dtype=index_dtype).element_size())
    ranks = []
    for r in range(3):
        values = (torch.arange(count, dtype=torch.float64) * (r + 1) - 2.5).to(value_dtype)
        indices = torch.arange(count, dtype=torch.int64).mul(r + 11).to(index_dtype)
        ranks.append((values, indices, layout.pack(values, indices)))
    gathered = torch.cat([packed for _, _, packed in ranks])  # what an allgather returns
    values, indices = layout.unpack(gathered, 3)
    for r, (v, i, _) in enumerate(ranks):
        assert torch.equal(values[r], v) and torch.equal(indices[r], i)


def test_wire_rejects_a_mismatched_gather():
    layout = wire.Layout(4, torch.float32, torch.int32)
    with pytest.raises(ValueError, match="ranks disagree"):
        layout.unpack(torch.zeros(layout.nbytes * 2 + 8, dtype=torch.uint8), 2)


def test_index_dtype_switches_at_2_pow_31():
    assert wire.index_dtype_for(2**31 - 1) == torch.int32
    assert wire.index_dtype_for(2**31) == torch.int64

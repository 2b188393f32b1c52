"""hvd_topk.TopK (hvd_topk/compressor.py), single process: its options checked by type and range,
the class and its instances as Horovod compressors."""

import re

import pytest
import torch


@pytest.mark.parametrize("kwargs, error, text", [
    ({"density": True}, TypeError, "density must be a number, got True"),
    ({"density": "0.01"}, TypeError, "density must be a number, got '0.01'"),
    ({"density": 0.0}, ValueError, "density must be in (0, 1], got 0.0"),
    ({"density": 2}, ValueError, "density must be in (0, 1], got 2"),
    ({"method": "Exact"}, ValueError, "method must be one of ('sampled', 'exact'), got 'Exact'"),
    ({"method": 1}, TypeError, "method must be a string"),
    ({"fp16_values": "no"}, TypeError, "fp16_values must be True or False, got 'no'"),
    ({"fp16_values": 1}, TypeError, "fp16_values must be True or False, got 1"),
    ({"fp16_values": None}, TypeError, "fp16_values must be True or False, got None"),
    ({"compact": "yes"}, TypeError, "compact must be True, False or 'sign', got 'yes'"),
    ({"compact": True, "fp16_values": True}, ValueError, "fp16_values and compact are two wire formats: choose one"),
])
def test_topk_options_checked_by_type_and_range(kwargs, error, text):
    import hvd_topk

    with pytest.raises(error, match=re.escape(text)):
        hvd_topk.TopK(**kwargs)


def test_topk_class_and_instance():
    import hvd_topk
    from horovod.torch.compression import Compressor

    assert issubclass(hvd_topk.TopK, Compressor)
    assert hvd_topk.TopK.default().density == 0.01
    assert hvd_topk.TopK.default() is hvd_topk.TopK.default()
    c = hvd_topk.TopK(density=0.001, fp16_values=True)
    assert isinstance(c, Compressor) and c.density == 0.001
    with pytest.raises(ValueError, match="1.5"):
        hvd_topk.TopK(density=1.5)
    # Its options are fixed once built (its per-shape plans were made from them): setting one says
    # so, where before a density set after the first compress was silently ignored.
    for name, value in (("density", 0.5), ("method", "exact"), ("fp16_values", False), ("compact", True)):
        with pytest.raises(AttributeError, match=f"TopK's {name} is fixed when it is built"):
            setattr(c, name, value)
        with pytest.raises(AttributeError, match=f"TopK's {name} is fixed when it is built"):
            setattr(hvd_topk.TopK, name, value)  # on the class it would replace every instance's
    assert (c.density, c.method, c.fp16_values, c.compact) == (0.001, "sampled", True, False)
    assert hvd_topk.TopK(density=0.3).density == 0.3 and hvd_topk.TopK.default().density == 0.01
    # Non-floating and empty tensors pass through without any communication.
    ints = torch.arange(5)
    assert hvd_topk.TopK.compress(ints) == (ints, None)
    empty = torch.empty(0)
    assert c.compress(empty)[1] is None and c.decompress(empty, None) is empty

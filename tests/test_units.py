"""Single-process tests: the contract's pieces against numpy and hand-computed cases."""

import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from hvd_topk import selection, wire
from reference import k_of, topk_sparse


@pytest.mark.parametrize("n,density,want", [(1000, 0.01, 10), (10, 0.01, 1), (150, 0.01, 2),
                                            (250, 0.01, 2), (7, 1.0, 7), (3, 0.5, 2), (0, 0.1, 0)])
def test_k_for_matches_contract(n, density, want):
    # hand-computed: max(1, round(d * n)); Python rounds half to even (2.5 -> 2, 1.5 -> 2)
    assert selection.k_for(n, density) == want


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), float("inf")])
def test_density_out_of_range_is_value_error_naming_it(bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        selection.check_density(bad)


@pytest.mark.parametrize("bad", ["abc", "0.5", None, True, False, [0.1]])
def test_density_not_a_number_is_type_error_naming_it(bad):
    # bools are ints to Python, but density=True must not silently mean 1.0
    with pytest.raises(TypeError, match=r"^density must be a number, got " + re.escape(repr(bad))):
        selection.check_density(bad)


def test_density_accepts_numpy_and_int_numbers():
    assert selection.check_density(np.float32(0.25)) == 0.25
    assert selection.check_density(1) == 1.0


def test_bad_method_is_value_error():
    with pytest.raises(ValueError, match="'fastest'"):
        selection.check_method("fastest")
    with pytest.raises(TypeError, match="method must be a string"):
        selection.check_method(None)


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
])
def test_topk_options_checked_by_type_and_range(kwargs, error, text):
    import hvd_topk

    with pytest.raises(error, match=re.escape(text)):
        hvd_topk.TopK(**kwargs)


@pytest.mark.parametrize("kwargs, error, text", [
    ({"warmup_density": True}, TypeError, "warmup_density must be a number, got True"),
    ({"momentum_correction": True}, TypeError, "momentum_correction must be a number, got True"),
    ({"momentum_correction": "0.9"}, TypeError, "momentum_correction must be a number"),
    ({"error_feedback": "yes"}, TypeError, "error_feedback must be True or False, got 'yes'"),
    ({"dense_fallback": 0}, TypeError, "dense_fallback must be True or False, got 0"),
])
def test_engine_options_checked_by_type(kwargs, error, text):
    from hvd_topk.engine import Options

    with pytest.raises(error, match=re.escape(text)):
        Options(**kwargs)


@pytest.mark.parametrize("n,density", [(1000, 0.01), (4096, 0.1), (333, 1.0), (50_000, 0.001)])
def test_exact_selection_matches_numpy(n, density):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)  # continuous: tie-free
    k = k_of(n, density)
    values, indices = selection.select(torch.from_numpy(x), k, "exact")
    _, keep = topk_sparse(x, density)
    assert sorted(indices.tolist()) == sorted(keep.tolist())
    np.testing.assert_array_equal(values.numpy(), x[indices.numpy()])


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
    # Non-floating and empty tensors pass through without any communication.
    ints = torch.arange(5)
    assert hvd_topk.TopK.compress(ints) == (ints, None)
    empty = torch.empty(0)
    assert c.compress(empty)[1] is None and c.decompress(empty, None) is empty


def test_missing_horovod_gives_install_instructions():
    code = ("import sys; sys.modules['horovod'] = None; sys.modules['horovod.torch'] = None\n"
            "import hvd_topk\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()
    assert any(line.startswith("ImportError: importing horovod.torch failed") for line in last), proc.stderr
    assert "docker/install.sh" in proc.stderr
    # a short message, not a deep traceback
    assert proc.stderr.count('File "') <= 3, proc.stderr


def test_checkpoint_names_map_torch_compile_prefix():
    from hvd_topk.engine import _match_names

    ours = ["fc.weight", "block.conv.weight"]
    saved = {"_orig_mod.fc.weight": 1, "block._orig_mod.conv.weight": 2, "gone.weight": 3}
    matched, dropped = _match_names(saved, ours)
    assert matched == {"fc.weight": 1, "block.conv.weight": 2} and dropped == ["gone.weight"]
    # and the reverse: plain names saved, compiled names here; an exact name wins
    matched, dropped = _match_names({"fc.weight": 1, "_orig_mod.x": 2}, ["_orig_mod.fc.weight", "_orig_mod.x"])
    assert matched == {"_orig_mod.fc.weight": 1, "_orig_mod.x": 2} and dropped == []


def test_dropped_residuals_warn_once_listing_a_few():
    from hvd_topk.engine import _warn_dropped

    with pytest.warns(UserWarning, match=r"7 saved error-feedback residual\(s\).*a0, a1, a2, a3, a4 and 2 more"):
        _warn_dropped([f"a{i}" for i in range(7)])


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


def test_bf16_allreduced_as_float32():
    from hvd_topk._horovod import allreduce_dtype

    assert allreduce_dtype(torch.bfloat16) == torch.float32
    assert allreduce_dtype(torch.float16) == torch.float16 and allreduce_dtype(torch.float32) == torch.float32


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

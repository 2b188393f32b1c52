"""hvd_topk/checkpoint.py, single process: saved residual names matched across torch.compile's
prefix, the warning for dropped residuals, the statistics a checkpoint carries."""

import pytest


def test_checkpoint_names_map_torch_compile_prefix():
    from hvd_topk.checkpoint import match_names as _match_names

    ours = ["fc.weight", "block.conv.weight"]
    saved = {"_orig_mod.fc.weight": 1, "block._orig_mod.conv.weight": 2, "gone.weight": 3}
    matched, dropped = _match_names(saved, ours)
    assert matched == {"fc.weight": 1, "block.conv.weight": 2} and dropped == ["gone.weight"]
    # and the reverse: plain names saved, compiled names here; an exact name wins
    matched, dropped = _match_names({"fc.weight": 1, "_orig_mod.x": 2}, ["_orig_mod.fc.weight", "_orig_mod.x"])
    assert matched == {"_orig_mod.fc.weight": 1, "_orig_mod.x": 2} and dropped == []


def test_checkpoint_names_map_the_ddp_wrapper_prefix():
    """DistributedDataParallel's named_parameters() add a leading "module." (twice when wrapped
    twice, and before torch.compile's prefix): saved either way, loaded the other way; a
    "module" inside the name is a real submodule and stays."""
    from hvd_topk.checkpoint import match_names

    ours = ["fc.weight", "block.module.conv.weight"]
    saved = {"module.fc.weight": 1, "module.block.module.conv.weight": 2, "module.gone": 3}
    assert match_names(saved, ours) == ({"fc.weight": 1, "block.module.conv.weight": 2}, ["module.gone"])
    assert match_names({"fc.weight": 1}, ["module.module.fc.weight"]) == ({"module.module.fc.weight": 1}, [])
    assert match_names({"module._orig_mod.fc.weight": 1}, ["fc.weight"]) == ({"fc.weight": 1}, [])
    assert match_names({"block.conv.weight": 1}, ["block.module.conv.weight"]) == ({}, ["block.conv.weight"])


def test_dropped_residuals_warn_once_listing_a_few():
    from hvd_topk.checkpoint import warn_dropped as _warn_dropped

    with pytest.warns(UserWarning, match=r"7 saved error-feedback residual\(s\).*a0, a1, a2, a3, a4 and 2 more"):
        _warn_dropped([f"a{i}" for i in range(7)])


def test_a_state_holding_nan_fingerprints_alike():
    """An elastic worker tells its own commit by a fingerprint of the state's residuals; a NaN in
    one made the fingerprint unequal to itself (nan != nan), so a worker's own state, copied as
    Horovod's commit copies it, was taken for another rank's and every residual restarted."""
    import copy

    import torch

    from hvd_topk.checkpoint import _fingerprint

    state = {"step": 5, "residuals": {"w": torch.tensor([1.0, float("nan"), -2.0]),
                                      "v": torch.tensor([float("inf"), 0.5], dtype=torch.float16)}}
    assert _fingerprint(copy.deepcopy(state)) == _fingerprint(state)
    other = copy.deepcopy(state)
    other["residuals"]["w"][0] = 1.5
    assert _fingerprint(other) != _fingerprint(state)


def test_a_whole_checkpoint_into_the_ddp_state_names_the_key_to_pass():
    """A training checkpoint ({"model": ..., "topk": state.state_dict()}) handed whole to
    TopKState.load_state_dict: the error names the key holding the state (it said only "not a
    TopKState state_dict"); anything else names what it got."""
    import pytest
    import torch
    import hvd_topk.ddp
    model = torch.nn.Linear(4, 4)
    state = hvd_topk.ddp.TopKState(density=0.01, named_parameters=model.named_parameters())
    whole = {"model": model.state_dict(), "topk": state.state_dict()}
    with pytest.raises(ValueError, match=r"it holds one under 'topk'; pass checkpoint\['topk'\]"):
        state.load_state_dict(whole)
    with pytest.raises(ValueError, match=r"got dict with keys \['a'\]"):
        state.load_state_dict({"a": 1})
    with pytest.raises(ValueError, match=r"got list"):
        state.load_state_dict([1])


def test_the_ddp_state_pickles_and_deep_copies_with_its_statistics():
    """DDP keeps the hook's state beside the model, so ``copy.deepcopy(ddp_model)`` (and
    ``AveragedModel``) copies it, and Lightning's spawn launcher pickles it. Its statistics held
    a lock, which neither can copy. The copy keeps the counts and counts on its own."""
    import copy
    import pickle

    import torch
    import hvd_topk.ddp

    state = hvd_topk.ddp.TopKState(density=0.1)
    state._stats.add(bytes_sent=12, bytes_dense=48)
    state._stats.add_tensor("nonfinite_resets", torch.tensor(2))
    for copied in (copy.deepcopy(state), pickle.loads(pickle.dumps(state))):
        counts = copied._stats.as_dict()
        assert (counts["bytes_sent"], counts["bytes_dense"], counts["nonfinite_resets"]) == (12, 48, 2)
        assert counts["bytes_ratio"] == 0.25
        copied._stats.add(bytes_sent=4)
        assert copied._stats.as_dict()["bytes_sent"] == 16 and state._stats.as_dict()["bytes_sent"] == 12


def test_statistics_counts_carried_and_checked():
    """What a checkpoint carries of the statistics (``CompressionStats.carried``): the counts as
    Python ints, device tensors read, the times left out; ``carry`` makes them the object's own
    (a pending device amount of the same count replaced, not added) while the times go on; a
    damaged entry is named by ``checkpoint.stats_problem`` (both front ends refuse the checkpoint with it)."""
    import torch
    from hvd_topk.checkpoint import stats_problem
    from hvd_topk.stats import CompressionStats

    stats = CompressionStats()
    stats.add(steps=3, bytes_sent=120, bytes_dense=4000, time_selection_s=0.5)
    stats.add_tensor("elements_selected", torch.tensor(30))
    counts = stats.carried()
    assert counts["steps"] == 3 and counts["bytes_sent"] == 120 and counts["elements_selected"] == 30
    assert all(type(v) is int for v in counts.values()) and "time_selection_s" not in counts
    assert stats_problem(counts) is None
    other = CompressionStats()
    other.add(steps=1, time_selection_s=0.25)
    other.add_tensor("elements_selected", torch.tensor(7))
    other.carry(counts)
    got = other.as_dict()
    assert (got["steps"], got["bytes_sent"], got["elements_selected"], got["time_selection_s"]) == (3, 120, 30, 0.25)
    assert got["bytes_ratio"] == 120 / 4000
    assert "is not a dict" in stats_problem([3])
    assert "holds ['steps'], not counts" in stats_problem({"steps": -1})
    assert "holds ['steps'], not counts" in stats_problem({"steps": 2.5})
    # a later version's statistic is neither refused nor taken
    later = {**counts, "bytes_received": 999}
    assert stats_problem(later) is None
    fresh = CompressionStats()
    fresh.carry(later)
    assert "bytes_received" not in fresh.as_dict() and fresh.as_dict()["bytes_sent"] == 120

"""hvd_topk/options.py: the engine's options checked by type, single process."""

import re

import pytest


@pytest.mark.parametrize("kwargs, error, text", [
    ({"warmup_density": True}, TypeError, "warmup_density must be a number, got True"),
    ({"momentum_correction": True}, TypeError, "momentum_correction must be a number, got True"),
    ({"momentum_correction": "0.9"}, TypeError, "momentum_correction must be a number"),
    ({"error_feedback": "yes"}, TypeError, "error_feedback must be True or False, got 'yes'"),
    ({"dense_fallback": 0}, TypeError, "dense_fallback must be True or False, got 0"),
    ({"residual_decay": "0.9"}, TypeError, "residual_decay must be a number"),
    ({"residual_decay": 0.0}, ValueError, "residual_decay must be in (0, 1], got 0.0"),
    ({"residual_decay": 1.5}, ValueError, "residual_decay must be in (0, 1], got 1.5"),
    ({"residual_decay": 0.9, "error_feedback": False}, ValueError, "residual_decay needs error_feedback=True"),
])
def test_engine_options_checked_by_type(kwargs, error, text):
    from hvd_topk.options import Options

    with pytest.raises(error, match=re.escape(text)):
        Options(**kwargs)


@pytest.mark.parametrize("kwargs, error, text", [
    ({"hierarchical": True, "exchange": "dense"}, ValueError, "hierarchical=True sends sparse pairs across hosts, "
                                                              "exchange='dense' every bucket dense"),
    ({"hierarchical": True, "exchange": "dense_fp16"}, ValueError, "exchange='dense_fp16' every bucket dense"),
])
def test_engine_option_combinations_refused(kwargs, error, text):
    from hvd_topk.options import Options

    with pytest.raises(error, match=re.escape(text)):
        Options(**kwargs)


@pytest.mark.parametrize("kwargs, ignored", [
    ({"exchange": "allgather", "exchange_trial_steps": 5}, "exchange_trial_steps has no effect with exchange='allgather'"),
    ({"exchange": "sparse_allreduce", "exchange_recheck_steps": 10, "exchange_trial_steps": 2},
     "exchange_trial_steps, exchange_recheck_steps have no effect with exchange='sparse_allreduce'"),
    ({"exchange": "dense", "selection_scope": "bucket", "dense_fallback": False},
     "selection_scope, dense_fallback have no effect with exchange='dense'"),
    ({"exchange": "auto", "exchange_trial_steps": 5, "selection_scope": "bucket"}, None),
    ({"exchange": "allgather", "selection_scope": "bucket", "dense_fallback": False}, None),
    ({"exchange": "dense_fp16"}, None),
    ({"exchange": "dense", "warmup_steps": 100, "warmup_density": 1.0},
     "warmup_steps, warmup_density have no effect with exchange='dense'"),
])
def test_options_without_effect_warn(kwargs, ignored):
    """An option set away from its default where the exchange never reads it (the trial's with a
    forced exchange, a sparse bucket's with a dense one) warns, naming it; otherwise silence."""
    import warnings

    from hvd_topk.options import Options

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Options(**kwargs)
    messages = [str(w.message) for w in caught]
    assert messages == ([ignored] if ignored else []), messages


def test_ddp_state_warns_of_a_trial_option_with_a_forced_exchange():
    import warnings

    import hvd_topk.ddp

    with pytest.warns(UserWarning, match=re.escape("exchange_trial_steps has no effect with exchange='allgather'")):
        hvd_topk.ddp.TopKState(exchange="allgather", exchange_trial_steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hvd_topk.ddp.TopKState(exchange="auto", exchange_trial_steps=5)


def test_a_warmup_that_does_nothing_warns():
    """A warm-up from a density at or below the target changes nothing: it warns, naming
    warmup_density (DensitySchedule, which both transports use); a real warm-up is silent and
    starts where it says (DGC's curve, hand-computed: 0.16 -> 0.01 over 4 steps halves twice)."""
    import warnings

    import hvd_topk.ddp
    from hvd_topk.schedule import DensitySchedule

    with pytest.warns(UserWarning, match=re.escape("warmup_density=0.001 is not above the density 0.01")):
        hvd_topk.ddp.TopKState(density=0.01, warmup_steps=10, warmup_density=0.001)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schedule = DensitySchedule(0.01, 4, 0.16)
        DensitySchedule(0.01, 0)  # no warm-up, warmup_density left at its default: nothing to say
    assert [schedule.density(s) for s in range(5)] == pytest.approx([0.16, 0.08, 0.04, 0.02, 0.01])


def test_ddp_state_warns_of_sparse_options_with_a_dense_exchange():
    """A density or its warm-up with exchange='dense': every bucket is sent whole, so they do
    nothing (they were accepted in silence); DeMo's accumulator sent whole loses its momentum."""
    import warnings

    import torch

    import hvd_topk
    import hvd_topk.ddp

    with pytest.warns(UserWarning, match=re.escape("density, warmup_steps have no effect with exchange='dense'")):
        hvd_topk.ddp.TopKState(exchange="dense", density=0.001, warmup_steps=10)
    model = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match=r"exchange='dense_fp16' over DeMo sends its accumulator .* whole"):
        hvd_topk.ddp.TopKState(exchange="dense_fp16", optimizer=hvd_topk.DeMo(model.parameters(), lr=0.01))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hvd_topk.ddp.TopKState(exchange="allgather", density=0.001, warmup_steps=10,
                               optimizer=hvd_topk.DeMo(model.parameters(), lr=0.01))


def test_warmup_density_without_warmup_steps_warns():
    """The recipe's dense start is two options; warmup_density=1.0 alone used to be accepted in
    silence and the run started at 1% (the density from step 0, hand-checked below)."""
    import hvd_topk.ddp
    from hvd_topk.schedule import DensitySchedule

    with pytest.warns(UserWarning, match=r"warmup_density=1.0 has no effect without warmup_steps"):
        schedule = DensitySchedule(0.01, 0, 1.0)
    assert schedule.density(0) == 0.01
    with pytest.warns(UserWarning, match=r"warmup_density=1.0 has no effect without warmup_steps"):
        hvd_topk.ddp.TopKState(density=0.01, warmup_density=1.0)


def test_the_exchange_names_are_the_strategies():
    """``exchange=`` accepts ``"auto"`` and the name of every Horovod strategy, nothing else: the
    names live in hvd_topk.checks (both transports; the DDP hook's list was a copy), the
    strategies in hvd_topk.exchange. A strategy added without its name, or a name without a
    strategy, fails here."""
    from hvd_topk import checks, exchange
    assert set(checks.EXCHANGES) == {"auto", *exchange.BY_NAME}
    assert {n for n, s in exchange.BY_NAME.items() if s.sparse} == set(checks.SPARSE_EXCHANGES)
    assert {n for n, s in exchange.BY_NAME.items() if not s.sparse} == set(checks.DENSE_EXCHANGES)


def test_group_options_compare_objects_by_value_unless_their_repr_is_an_address():
    """What the ranks compare of their optimizers' settings (the engine every step, LocalSteps
    at each synchronisation, the DDP hook once): a dtype or an enum by its value (by its type's
    name alone, bfloat16 and float32 counted as agreeing); an object with the default repr,
    which names its address and so differs by rank, by its type; a tensor by its values."""
    import enum

    import torch
    from hvd_topk.agreement import group_options

    Tag = type("Tag", (), {})
    Mode = enum.Enum("Mode", "A B")

    def options(**group):
        return group_options([{"params": [], **group}])

    assert options(d=torch.bfloat16) != options(d=torch.float32)
    assert options(m=Mode.A) != options(m=Mode.B)
    assert options(m=Mode.A) == options(m=Mode.A)
    assert options(t=Tag()) == options(t=Tag()) == [[("t", "Tag")]]
    assert options(lr=torch.tensor(0.5)) == options(lr=0.5)
    assert options(betas=(0.9, torch.tensor([0.5, 0.25]))) == [[("betas", (0.9, (0.5, 0.25)))]]
    assert group_options([{"params": [], "hvd_topk_x": 1, "lr": 1}], leave_out="hvd_topk_") == [[("lr", 1)]]

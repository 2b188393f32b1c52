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

"""The examples' --help (examples/cli.py): every option's default is shown, and it is the
default the example's parser returns. Imports the example scripts (torch, Horovod), no MPI."""

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _example_module(name):
    """The example script ``examples/NAME.py`` as a module (its folder on the path while it
    imports its siblings, as when run as a script)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "examples"))


def test_example_help_shows_every_default():
    """The examples' --help names each option's default (hand-written expectations on a toy
    parser: no help string, a help that names its default already, a flag, a zero)."""
    cli = _example_module("cli")
    p = argparse.ArgumentParser(prog="x", formatter_class=cli.HelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--clip", type=float, default=1.0, help="clipping (default 1.0; 0: off)")
    p.add_argument("--quiet", action="store_true", help="less output")
    p.add_argument("--warmup", type=int, default=0, help="dense steps")
    p.add_argument("--json", default=None, help="where")
    p.add_argument("--adam", default="adamw", help="local: beta1 0 by default")
    text = " ".join(p.format_help().split())
    assert "--steps STEPS (default: 5)" in text
    assert "clipping (default 1.0; 0: off) --quiet" in text
    assert "less output --warmup WARMUP dense steps (default: 0) --json JSON where" in text
    assert "--json JSON where --adam ADAM local: beta1 0 by default (default: adamw)" in text


@pytest.mark.parametrize("script", ["pytorch_gpt", "pytorch_digits", "pytorch_elastic"])
def test_example_help_defaults_are_the_parsed_ones(script, capsys):
    """Each option's default in the example's --help is what its parser returns with no flags."""
    module = _example_module(script)
    defaults = vars(module.parse_args([]))
    with pytest.raises(SystemExit):
        module.parse_args(["--help"])
    entries = re.split(r"\n  (?=-)", capsys.readouterr().out)[1:]  # one per option, wrapped lines inside
    shown = {}
    for entry in entries:
        entry = " ".join(entry.split())
        default = re.search(r"\(default: ([^)]*)\)$", entry)
        if default:
            shown[re.match(r"--([a-z0-9-]+)", entry).group(1)] = default.group(1)
    assert len(shown) >= 7, shown
    for flag, value in shown.items():
        assert str(defaults[flag.replace("-", "_")]) == value, flag


def test_gpt_example_refuses_adam_betas_with_demo(capsys):
    """DeMo keeps no Adam moments: --beta1/--beta2 with --adam demo are a usage error naming
    them, not silently dropped; elsewhere --beta2 is what was passed, 0.95 when not."""
    module = _example_module("pytorch_gpt")
    demo = ["--optimizer", "topk-ef", "--compression", "topk", "--adam", "demo", "--clip", "0"]
    for flag in ("--beta1", "--beta2"):
        with pytest.raises(SystemExit):
            module.parse_args([*demo, flag, "0.9"])
        assert "--beta1 and --beta2 do not apply to --adam demo" in capsys.readouterr().err
    assert module.parse_args(demo).beta2 == 0.95
    local = ["--optimizer", "topk-ef", "--compression", "topk", "--adam", "local", "--clip", "0"]
    assert module.parse_args([*local, "--beta2", "0.9"]).beta2 == 0.9
    assert module.parse_args(local).beta2 == 0.95


def test_gpt_example_one_momentum_with_frozen_variance():
    """--adam frozen-variance with error feedback moves beta1 (default 0.9, or --beta1) into the
    exchange's momentum_correction and leaves the inner beta1 at 0; elsewhere --beta1 is Adam's."""
    module = _example_module("pytorch_gpt")
    frozen = ["--optimizer", "topk-ef", "--compression", "topk", "--adam", "frozen-variance", "--freeze-step", "10",
              "--warmup-steps", "10", "--warmup-density", "1.0"]
    pick = module.beta1_and_momentum_correction
    assert pick(module.parse_args(frozen)) == (0.0, 0.9)
    assert pick(module.parse_args([*frozen, "--beta1", "0.8"])) == (0.0, 0.8)
    assert pick(module.parse_args([*frozen, "--beta1", "0.8", "--no-error-feedback"])) == (0.8, 0.0)
    assert pick(module.parse_args(["--beta1", "0.8"])) == (0.8, 0.0)
    assert pick(module.parse_args(["--optimizer", "topk-ef", "--adam", "local", "--clip", "0"])) == (0.0, 0.0)


@pytest.mark.parametrize("argv, message", [
    (["--warmup-density", "0.5"], "--warmup-density only applies to --optimizer topk-ef"),
    (["--optimizer", "topk-ef", "--warmup-density", "1.0"], "--warmup-density sets where the density warm-up "
                                                            "starts: it needs --warmup-steps N > 0"),
    (["--optimizer", "topk-ef", "--warmup-steps", "100", "--warmup-density", "5"], "--warmup-density must be in (0, 1]"),
    (["--optimizer", "topk-ef", "--warmup-steps", "2", "--sync-every", "4"], "shorter than one synchronisation"),
])
def test_gpt_example_refuses_a_warmup_density_that_would_do_nothing(argv, message, capsys):
    """A dense-start flag that would be silently ignored (no --warmup-steps, not topk-ef) or is out
    of range is a usage error naming it."""
    module = _example_module("pytorch_gpt")
    with pytest.raises(SystemExit):
        module.parse_args(argv)
    assert message in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("script, argv, message", [
    ("pytorch_digits", ["--compression", "none", "--density", "0.1"], "--density only applies to --compression topk"),
    ("pytorch_digits", ["--compression", "fp16", "--density", "7"], "--density only applies to --compression topk"),
    ("pytorch_digits", ["--optimizer", "topk-ef", "--hierarchical", "--exchange", "dense"],
     "--exchange dense sends every bucket dense"),
    ("pytorch_elastic", ["--optimizer", "dense", "--density", "0.05"], "--density only applies to --optimizer"),
    ("pytorch_elastic", ["--density", "1.5"], "--density"),
    ("pytorch_elastic", ["--fail-epoch", "2"], "--fail-epoch only applies with --fail-rank"),
    ("pytorch_elastic", ["--fail-rank", "1", "--fail-epoch", "4"], "or the failure never happens"),
    ("pytorch_elastic", ["--epochs", "0"], "--epochs must be a positive integer"),
    ("pytorch_gpt", ["--vector-lr-scale", "0"], "--vector-lr-scale must be > 0, got 0.0"),
])
def test_examples_refuse_flags_that_would_do_nothing(script, argv, message, capsys):
    """A flag the example would ignore, or a failure that would never happen, is a usage error."""
    module = _example_module(script)
    with pytest.raises(SystemExit):
        module.parse_args(argv)
    assert message in " ".join(capsys.readouterr().err.split())


def test_elastic_example_accepts_its_documented_failure():
    """docs/api.md's command (--epochs 4 --fail-rank 1 --fail-epoch 1) parses."""
    args = _example_module("pytorch_elastic").parse_args(["--epochs", "4", "--fail-rank", "1", "--fail-epoch", "1"])
    assert (args.fail_rank, args.fail_epoch) == (1, 1)


@pytest.mark.parametrize("script, argv, says", [
    ("pytorch_gpt", ["--clip", "-1"], "--clip must be a finite norm >= 0"),
    ("ddp_gpt", ["--hook", "none", "--clip", "-1"], "--clip must be a finite norm >= 0"),
    ("pytorch_gpt", ["--lr", "nan"], "--lr must be in (0, inf), got nan"),
    ("pytorch_gpt", ["--lr", "inf"], "--lr must be in (0, inf), got inf"),
    ("pytorch_gpt", ["--weight-decay", "nan"], "--weight-decay must be in [0, inf), got nan"),
    ("pytorch_digits", ["--lr", "nan"], "--lr must be in (0, inf), got nan"),
    ("pytorch_digits", ["--momentum", "1.5"], "--momentum must be in [0, 1), got 1.5"),
    ("pytorch_elastic", ["--lr", "inf"], "--lr must be in (0, inf), got inf"),
    ("pytorch_elastic", ["--epoch-wait", "nan"], "--epoch-wait must be in [0, inf), got nan"),
    ("lightning_digits", ["--lr", "inf"], "--lr must be in (0, inf), got inf"),
    ("ddp_gpt", ["--weight-decay", "nan"], "--weight-decay must be in [0, inf), got nan"),
    ("ddp_gpt", ["--warmup-density", "5"], "--warmup-density must be in (0, 1], got 5.0"),
    ("ddp_gpt", ["--bucket-cap-mb", "nan"], "--bucket-cap-mb must be in (0, inf), got nan"),
    ("ddp_gpt", ["--exchange", "dense", "--density", "0.5"], "--exchange dense sends every bucket whole: --density"),
    ("pytorch_gpt", ["--optimizer", "topk-ef", "--compression", "topk", "--exchange", "dense_fp16", "--fp16-values"],
     "--exchange dense_fp16 sends every bucket whole: --fp16-values would do nothing"),
    ("pytorch_digits", ["--optimizer", "topk-ef", "--compression", "topk", "--exchange", "dense", "--density", "0.001",
                        "--no-error-feedback"], "sends every bucket whole: --density, --no-error-feedback would do nothing"),
    ("pytorch_gpt", ["--optimizer", "topk-ef", "--compression", "topk", "--min-numel", "-5"], "--min-numel must be >= 0"),
    ("pytorch_gpt", ["--optimizer", "topk-ef", "--compression", "topk", "--sync-every", "2", "--outer-lr", "-1"],
     "--outer-lr must be in (0, inf), got -1.0"),
    ("pytorch_gpt", ["--optimizer", "topk-ef", "--compression", "topk", "--sync-every", "2", "--outer-momentum", "nan"],
     "--outer-momentum must be in [0, 1), got nan"),
    ("pytorch_gpt", ["--optimizer", "topk-ef", "--compression", "topk", "--adam", "frozen-variance",
                     "--freeze-step", "10"], "needs a dense start up to the freeze: --warmup-steps 10 (or more)"),
    ("pytorch_gpt", ["--freeze-step", "-3"], "--adam frozen-variance needs --freeze-step N > 0"),
    ("pytorch_gpt", ["--optimizer", "topk-ef", "--compression", "topk", "--sync-every", "4", "--steps", "6",
                     "--eval-every", "4"], "--steps (6) must be a multiple of --sync-every (4)"),
    ("ddp_gpt", ["--hook", "powersgd", "--bucket-cap-mb", "1"], "leave --bucket-cap-mb out"),
    ("ddp_gpt", ["--warmup-steps", "0", "--warmup-density", "0.5"], "it needs --warmup-steps N > 0"),
    ("pytorch_gpt", ["--resume"], "--resume, --checkpoint-every and --stop-after need --checkpoint PREFIX"),
    ("pytorch_gpt", ["--checkpoint", "ck", "--stop-after", "300"], "--stop-after must be in [1, --steps=300)"),
    ("pytorch_gpt", ["--checkpoint", "no/such/dir/ck"], "no/such/dir/ck: its directory no/such/dir does not exist"),
    ("lightning_digits", ["--epochs", "0"], "--epochs, --batch-size and --devices must be positive"),
    ("lightning_digits", ["--epochs", "-1"], "--epochs, --batch-size and --devices must be positive"),
    ("lightning_digits", ["--density", "0"], "--density must be in (0, 1]"),
])
def test_examples_refuse_what_would_train_wrong(script, argv, says, capsys):
    """Settings that trained silently wrong (a negative clip is gradient ascent; a NaN or
    infinite rate or weight decay; a momentum of 1 or more; Top-K flags under a pinned dense
    exchange, which ignores them; FrozenVarianceAdamW freezing entries Top-K never sent;
    local steps ending between synchronisations, where the ranks' models differ; Lightning
    with no epochs, or -1, which it takes as unlimited) or failed deep inside (PowerSGD over
    several gloo buckets; a density of 0) are usage errors naming the flag, before anything runs."""
    module = _example_module(script)
    with pytest.raises(SystemExit) as stop:
        (module.main if script == "lightning_digits" else module.parse_args)(argv)
    assert stop.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("script", ["pytorch_digits", "pytorch_gpt", "ddp_gpt", "lightning_digits"])
@pytest.mark.parametrize("where, says", [("missing-dir/out.json", "does not exist"), (".", "is a directory")])
def test_examples_refuse_a_json_path_they_could_not_write(script, where, says, tmp_path, capsys):
    """--json is written after training: a path that cannot be written is a usage error up
    front, not a traceback after the run it reports on."""
    module = _example_module(script)
    with pytest.raises(SystemExit) as stop:
        (module.main if script == "lightning_digits" else module.parse_args)(["--json", str(tmp_path / where)])
    assert stop.value.code == 2
    assert says in capsys.readouterr().err


def test_examples_accept_a_json_path_in_an_existing_directory(tmp_path):
    args = _example_module("pytorch_digits").parse_args(["--json", str(tmp_path / "out.json")])
    assert args.json == str(tmp_path / "out.json") and not (tmp_path / "out.json").exists()


def test_one_rank_reports_no_bytes_whatever_the_optimizer(tmp_path):
    """One rank exchanges nothing: the drop-in TopK reported 0 bytes and hvd_topk's optimizer
    605,224 (100%, its local no-op allreduce counted); both report 0 now, as the DDP example does."""
    import json
    import subprocess

    sent = {}
    for name, args in (("drop-in", ["--compression", "topk"]), ("topk-ef", ["--optimizer", "topk-ef"])):
        out = tmp_path / f"{name}.json"
        proc = subprocess.run([sys.executable, str(ROOT / "examples" / "pytorch_digits.py"), "--epochs", "1",
                               "--quiet", "--json", str(out), *args], capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "one rank: nothing is exchanged" in proc.stdout, proc.stdout
        sent[name] = json.loads(out.read_text())["bytes_sent_per_step"]
    assert sent == {"drop-in": 0, "topk-ef": 0}, sent


def test_ddp_example_without_cuda_refuses_device_cuda(monkeypatch, capsys):
    """--device cuda where torch sees no GPU: a usage error, not NCCL's traceback from every rank."""
    module = _example_module("ddp_gpt")
    monkeypatch.setattr(module.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        module.parse_args(["--device", "cuda"])
    assert stop.value.code == 2
    assert "--device cuda: no CUDA device here" in capsys.readouterr().err

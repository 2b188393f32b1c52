"""Import Horovod's PyTorch API, or fail with a message that says how to get it."""

INSTALL_HINT = (
    "hvd_topk needs Horovod (0.28.1) built with PyTorch support. From a clone of hvd_topk run\n"
    "    bash docker/install.sh\n"
    "which installs OpenMPI and builds Horovod with PyTorch, MPI and Gloo into ./.venv.\n"
    "By hand: apt-get install libopenmpi-dev openmpi-bin cmake g++, install torch first, then\n"
    "    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \\\n"
    "    pip install --no-build-isolation horovod==0.28.1\n"
    "(with PyTorch >= 2.1 the compiler must use -std=c++17; see README 'Installing')."
)


def import_horovod_torch():
    """Return the ``horovod.torch`` module or raise ImportError with install instructions."""
    try:
        import horovod.torch as hvd
    except ImportError as exc:  # also covers a Horovod built without PyTorch
        raise ImportError(f"importing horovod.torch failed ({exc}).\n{INSTALL_HINT}") from None
    return hvd

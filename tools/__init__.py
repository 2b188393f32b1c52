"""Tooling for hvd_topk's tests and benchmarks, kept out of the installed package (the wheel
ships only ``hvd_topk``). Import it from the repository root (``python -m tools.emulated_hosts``;
tests/conftest.py and benchmarks/_common.py put the root on ``sys.path``).

- ``launch``: the one ``mpirun`` command line used by tests, benchmarks and examples' scripts.
- ``machine``: where and when a result was made (CPU, cores, versions, git commit).
- ``emulated_hosts``: several "hosts" on one machine (network namespaces, shaped links, sshd).
- ``shapes``: parameter shapes of ResNet-50 and BERT-base, for realistic gradient layouts.
- ``horovod_suite``: Horovod's own optimizer tests run with hvd_topk's optimizer (a script).
"""

"""Tooling for hvd_topk's tests and benchmarks (not needed to train with hvd_topk).

- ``launch``: the one ``mpirun`` command line used by tests, benchmarks and examples' scripts.
- ``machine``: where and when a result was made (CPU, cores, versions, git commit).
- ``emulated_hosts``: several "hosts" on one machine (network namespaces, shaped links, sshd).
- ``shapes``: parameter shapes of ResNet-50 and BERT-base, for realistic gradient layouts.
"""

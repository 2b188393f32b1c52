"""``python -m hvd_topk.native``: build the native kernel now (set-up runs this) and print its path."""

from hvd_topk.native import build

print(build(verbose=True))

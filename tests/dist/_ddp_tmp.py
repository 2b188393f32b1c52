import sys
import check_ddp as m
from torchrun_harness import run
run([(n, f) for n, f in m.CHECKS if any(s in n for s in sys.argv[1:])], argv=[])

# How long TopK's backward waits for its round's probe (at the round's second compress), ResNet-50, 2 ranks
import sys, time, torch, horovod.torch as hvd
sys.path.insert(0, "/work/main/benchmarks")
import hvd_topk
from hvd_topk import exchange
from _models import build_resnet50
hvd.init(); torch.set_num_threads(1)
waits = []
orig = exchange.ActiveRanks.read
def timed(self):
    t0 = time.perf_counter(); out = orig(self); waits.append(time.perf_counter() - t0); return out
exchange.ActiveRanks.read = timed
model = build_resnet50(torch)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                               named_parameters=model.named_parameters(), compression=hvd_topk.TopK)
x = torch.randn(8, 3, 32, 32); y = torch.randint(0, 1000, (8,))
steps = []
for step in range(12):
    opt.zero_grad()
    t0 = time.perf_counter()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    steps.append(time.perf_counter() - t0)
    if step == 3: waits.clear(); steps.clear()
if hvd.rank() in (0, 1):
    w = sorted(waits); s = sorted(steps)
    print(f"rank {hvd.rank()}: probe wait per step median {1e3*w[len(w)//2]:.2f} ms, max {1e3*w[-1]:.2f} ms; step median {1e3*s[len(s)//2]:.0f} ms", flush=True)

"""A/B on a GPU, one process: select_segments_torch before (468c9ba) and after (50c42ef) the change
that built a bucket's constants once and dropped repeat_interleave, bincount and index_add_ from
the sampled path. Checks first that both give bitwise the same values, indices and flags on
CUDA (48 cases: fp32/bf16, sampled/exact, with inf/NaN and with ties), then times both at
ResNet-50's and BERT-base's shapes (CUDA events: GPU time; perf_counter: host time to return).

Run from the repository root at 50c42ef or later, on a GPU machine:
    git show 468c9ba:hvd_topk/selection.py > ab_old_selection.py
    OUT=DIR python benchmarks/results/gpu/ab_selection_50c42ef.py     # writes DIR/ab-selection.json
"""
import importlib.util, json, os, statistics, sys, time, torch, math
sys.path.insert(0, "benchmarks")  # _common: the models' tensor shapes
import _common as common
from hvd_topk import selection as new
spec = importlib.util.spec_from_file_location("oldsel", "ab_old_selection.py"); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
dev = torch.device("cuda")
def ms(fn, repeats=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); t0 = time.perf_counter(); fn(); t1 = time.perf_counter(); e.record(); e.synchronize()
        gpu.append(s.elapsed_time(e)); host.append((t1 - t0) * 1e3)
    return round(statistics.median(gpu), 3), round(statistics.median(host), 3)
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
# bitwise equality on CUDA, with inf/nan and ties
for trial in range(12):
    g = torch.Generator().manual_seed(trial)
    sizes = [int(v) for v in torch.randint(1, 200000, (25,), generator=g)]
    ks = [new.k_for(n, 0.01) for n in sizes]
    x = torch.randn(sum(sizes), generator=g)
    if trial % 3 == 1: x[torch.randint(x.numel(), (9,), generator=g)] = torch.tensor([math.inf, -math.inf, math.nan] * 3)
    if trial % 3 == 2: x = (x * 2).round().clamp(-1, 1)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype).to(dev)
        for method in ("sampled", "exact"):
            a = old.select_segments_torch(xd, sizes, ks, method, seed=trial)
            b = new.select_segments_torch(xd, sizes, ks, method, seed=trial)
            for u, v in zip(a, b):
                assert torch.equal(u.double().nan_to_num(7.0), v.double().nan_to_num(7.0)), (trial, dtype, method)
print("old and new bitwise identical on CUDA: 48 cases", flush=True)
for model in ["resnet50", "bert-base"]:
    sizes = [int(torch.Size(s).numel()) for s in common.model_shapes(model)]
    ks = [new.k_for(s, 0.01) for s in sizes]
    x = torch.randn(sum(sizes), device=dev)
    for method in ("sampled", "exact"):
        o = ms(lambda: old.select_segments_torch(x, sizes, ks, method))
        n = ms(lambda: new.select_segments_torch(x, sizes, ks, method))
        row = {"model": model, "method": method, "old_gpu_ms": o[0], "old_host_ms": o[1], "new_gpu_ms": n[0], "new_host_ms": n[1]}
        out["rows"].append(row); print(row, flush=True)
    fl = ms(lambda: x.sum()); tk = ms(lambda: [torch.topk(t.abs(), k, sorted=False) for t, k in zip(x.split(sizes), ks)])
    out["rows"].append({"model": model, "floor_gpu_ms": fl[0], "topk_per_tensor_gpu_ms": tk[0], "topk_per_tensor_host_ms": tk[1]})
    print(out["rows"][-1], flush=True)
open(os.path.join(os.environ.get("OUT", "/tmp"), "ab-selection.json"), "w").write(json.dumps(out, indent=1))

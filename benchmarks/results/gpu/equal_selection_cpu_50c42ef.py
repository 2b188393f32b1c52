"""The CPU half of ab_selection_50c42ef.py's equality check: select_segments_torch before (468c9ba)
and after (50c42ef) on 120 random buckets (2-60 segments, sizes 0 to 150,000, densities 0.1-50%,
fp32/fp16/bf16/fp64, with inf/NaN, with ties, with a few huge values), sampled and exact, the
same seed for both: values, indices and flags must be bitwise the same. Run from the repository
root, the native kernel off so that the CPU takes the torch-ops path:
    git show 468c9ba:hvd_topk/selection.py > ab_old_selection.py
    HVD_TOPK_NATIVE=0 PYTHONPATH=. python benchmarks/results/gpu/equal_selection_cpu_50c42ef.py
"""
import importlib.util, sys, torch, math, random
from hvd_topk import selection as new
spec = importlib.util.spec_from_file_location("oldsel", "ab_old_selection.py"); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
rng = random.Random(1)
cases = 0
for trial in range(60):
    nseg = rng.choice([2, 3, 7, 20, 60])
    sizes = [rng.choice([0, 1, 5, 300, 2048, 2049, 5000, 40000, 150000]) for _ in range(nseg)]
    if sum(sizes) == 0: sizes[0] = 10
    dens = rng.choice([0.001, 0.01, 0.1, 0.5])
    ks = [new.k_for(n, dens) for n in sizes]
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16, torch.float64])
    g = torch.Generator().manual_seed(trial)
    x = torch.randn(sum(sizes), generator=g).to(dtype)
    kind = trial % 4
    if kind == 1 and x.numel() > 10:  # non-finite entries
        for v in (math.inf, -math.inf, math.nan):
            x[torch.randint(x.numel(), (3,), generator=g)] = v
    if kind == 2:  # heavy ties / many zeros: candidates run short or over
        x = (x * 2).round().clamp(-1, 1)
    if kind == 3:  # a structured gradient: a few huge values per segment
        x[torch.randint(x.numel(), (x.numel() // 50 + 1,), generator=g)] *= 1000
    for method in ("sampled", "exact"):
        a = old.select_segments_torch(x, sizes, ks, method, seed=trial)
        b = new.select_segments_torch(x, sizes, ks, method, seed=trial)
        for u, v, name in zip(a, b, ("values", "indices", "nonfinite")):
            assert u.dtype == v.dtype and u.shape == v.shape, (trial, method, name, u.dtype, v.dtype, u.shape, v.shape)
            assert torch.equal(u.view(-1).double().nan_to_num(12345.0), v.view(-1).double().nan_to_num(12345.0)), (trial, method, name, sizes, ks, dtype)
        cases += 1
print("identical in", cases, "cases")

"""H2O's received-attention kernel (`kernels/palu_kernels/received.py`) on a GPU: correctness
against the torch path (`src/palu/attention/received.py`, float32 reference) at SmolLM2's shapes,
left-padded rows (a pad at position -1, as `H2OPolicy.keep_padded` places them), then the time
of a 64-prompt x 4K prefill's sums beside the chunked torch path. Needs only torch and triton (the
two files are loaded by path), so it runs on a GPU host before anything is staged.

  python benchmarks/experiments/received_kernel_check.py OUT.json     # KSMALL=1: CPU, interpreter

Results: results/checks/h100-received-kernel-session48.json."""
import json, sys, time, torch
import importlib.util
# the torch reference straight from its file: `import palu` would need the wheelhouse on the host
_spec = importlib.util.spec_from_file_location("received_ref", "src/palu/attention/received.py")
rec = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(rec)
_spec = importlib.util.spec_from_file_location("received_kernel", "kernels/palu_kernels/received.py")
_k = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(_k)
attention_received = _k.attention_received

import os
SMALL = os.environ.get("KSMALL") == "1"   # a CPU dry run through the interpreter
dev = "cpu" if SMALL else "cuda"
out = {"device": "cpu" if SMALL else torch.cuda.get_device_name(), "checks": [], "timings": []}
def case(B, T, S, Hq=9, H=3, D=64, dtype=torch.float16, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(B, Hq, T, D, generator=g, device=dev, dtype=dtype)
    k = torch.randn(B, H, S, D, generator=g, device=dev, dtype=dtype)
    lengths = torch.linspace(T, max(1, T // 8), B, device=dev).long()
    pad = (T - lengths)[:, None]
    ar = torch.arange(T, device=dev)[None]
    q_pos = (ar - pad + (S - T)).masked_fill(ar < pad, -1)   # a pad: -1 (slots in position order)
    k_pos = torch.cat([torch.arange(S - T, device=dev).expand(B, H, S - T), q_pos[:, None].expand(B, H, T)], 2).contiguous()
    return q, k, q_pos, k_pos

for (B, T, S) in ([(2, 40, 40), (3, 1, 70), (4, 37, 50)] if SMALL else [(2, 4032, 4032), (3, 1, 4096), (2, 64, 4096), (4, 777, 1000)]):
    q, k, qp, kp = case(B, T, S)
    ref = rec.received_torch(q.float(), k.float(), qp, kp, 0.125)
    for bm, bn in ([(16, 16)] if SMALL else [(64, 64), (128, 64), (64, 128)]):
        got = attention_received(q, k, qp, kp, 0.125, block_m=bm, block_n=bn)
        err = (got - ref).abs().max().item(); rel = err / ref.abs().max().item()
        out["checks"].append(dict(B=B, T=T, S=S, block=[bm, bn], max_abs=err, rel_to_max=rel,
                                  pads_zero=bool(got[kp < 0].abs().max().item() == 0) if (kp < 0).any() else True))
        print(out["checks"][-1], flush=True)
    del q, k, ref

def timed(fn, reps=5):
    if SMALL:
        fn(); return 0.0
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(True); b = torch.cuda.Event(True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]

B, T, S, Hq, D = (2, 40, 40, 9, 64) if SMALL else (64, 4032, 4032, 9, 64)
q, k, qp, kp = case(B, T, S)
visible = float(((kp[:, :1, None, :] >= 0) & (kp[:, :1, None, :] <= qp[:, None, :, None])).sum().item())  # per q head
flops_pass = 2.0 * D * visible * Hq     # QK^T over visible pairs, one pass
for bm, bn in ([(16, 16)] if SMALL else [(64, 64), (128, 64), (64, 128), (128, 128)]):
    try:
        ms = timed(lambda: attention_received(q, k, qp, kp, 0.125, block_m=bm, block_n=bn))
        out["timings"].append(dict(path="kernel", block=[bm, bn], ms=ms, tflops_2pass=2 * flops_pass / ms / 1e9 if ms else None))
    except Exception as e:
        out["timings"].append(dict(path="kernel", block=[bm, bn], error=repr(e)[:300]))
    print(out["timings"][-1], flush=True)
ms = timed(lambda: rec.received_torch(q, k, qp, kp, 0.125), reps=3)
out["timings"].append(dict(path="torch-chunked", ms=ms))
print(out["timings"][-1], flush=True)
out["shape"] = dict(B=B, T=T, S=S, Hq=Hq, H=3, D=D, visible_pairs_per_head=visible, flops_one_pass=flops_pass)
json.dump(out, open(sys.argv[1], "w"), indent=1)

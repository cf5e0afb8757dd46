"""Where the latent-selection attend step's time goes on a GPU (issue 39 item 3): torch.profiler
over the float32 and the SDPA paths of `palu_kernels.latent_select` at Llama-2-7B shapes, 64K
tokens, k = 1024 + 32 chosen per head; prints the CUDA-time table of each. Run on a GPU host:
    PYTHONPATH=src:kernels python benchmarks/experiments/select_attend_profile.py
"""
import math

import torch
from torch.profiler import ProfilerActivity, profile

from palu_kernels.latent_select import attend_selected, attend_selected_sdpa, rope_table, rotate_query


def main(T=65536, H=32, D=128, R=64, n=1056):
    g = torch.Generator(device="cuda").manual_seed(0)
    hk = torch.randn(1, H, T, R, device="cuda", dtype=torch.float16, generator=g)
    hv = torch.randn(1, H, T, R, device="cuda", dtype=torch.float16, generator=g)
    bk = torch.randn(H, D, R, device="cuda", dtype=torch.float16, generator=g) / math.sqrt(R)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    q = torch.randn(1, H, D, device="cuda", dtype=torch.float16, generator=g)
    q_rot = rotate_query(q, T, inv_freq).half()
    idx = torch.randint(0, T, (1, H, n), device="cuda", generator=g).sort(-1).values
    table = rope_table(T, inv_freq, torch.float16)
    for name, fn in (("fp32", lambda: attend_selected(q_rot, hk, hv, bk, idx, inv_freq, 1 / math.sqrt(D), 1)),
                     ("sdpa", lambda: attend_selected_sdpa(q_rot, hk, hv, bk, idx, table, 1 / math.sqrt(D), 1))):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        print(f"== {name}: CUDA time per call by kernel (20 calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))


if __name__ == "__main__":
    main()

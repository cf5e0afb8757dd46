"""A/B on the GPU (random SmolLM2-135M weights, batch 64 x ~4K-token left-padded prompts, 64
greedy tokens, EOS off): transformers `generate` with no cache given, with `DynamicCache()`, with
`DynamicCache(config=...)`, and `palu.eval.generation.answer_batches` with the fp16 method, each
twice after one warm-up. Seen on the H200 (2026-12-03): 3.5-3.9 s, 3.8-3.9 s, 3.5-3.8 s and
3.3-3.5 s: the suites' path adds nothing to transformers' own dynamic-cache generate."""
import time, torch, sys
sys.path[:0] = ["src", "benchmarks"]   # run from the repository root on a GPU host
from transformers import LlamaConfig, LlamaForCausalLM, DynamicCache
from palu_bench.long_throughput import SMOLLM2
torch.manual_seed(0)
m = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to("cuda", torch.float16).eval()
m.generation_config.eos_token_id = None
B, T = 64, 4032
lens = [T - (i * 37) % 500 for i in range(B)]
ids = torch.randint(5, 40000, (B, T), device="cuda")
mask = torch.ones(B, T, dtype=torch.long, device="cuda")
for i, n in enumerate(lens):
    mask[i, :T - n] = 0; ids[i, :T - n] = 2
def run(label, **kw):
    torch.cuda.synchronize(); t = time.perf_counter()
    with torch.no_grad():
        m.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False, pad_token_id=2, **kw)
    torch.cuda.synchronize(); print(label, round(time.perf_counter() - t, 3), flush=True)
run("warm")
for _ in range(2):
    run("none")
    run("dyn()", past_key_values=DynamicCache())
    run("dyn(config)", past_key_values=DynamicCache(config=m.config))
from palu.eval.generation import answer_batches
class Tok:
    pad_token_id, eos_token_id = 2, None
    def decode(self, ids, skip_special_tokens=True): return ""
from palu.methods import build_method
fp = build_method({"name": "fp16"})
prompts = [ids[i, T - n:].tolist() for i, n in enumerate(lens)]
for _ in range(2):
    torch.cuda.synchronize(); t = time.perf_counter()
    answer_batches(m, Tok(), fp, prompts, 64, batch_size=64)
    torch.cuda.synchronize(); print("answer_batches", round(time.perf_counter() - t, 3), flush=True)

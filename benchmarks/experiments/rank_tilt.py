"""Experiment (issue 21, session 15): error_aware with a depth tilt on its output-Fisher weights
(layer l x e^{t(1 - l/(L-1))}), M-LRD kept 0.3 / 0.5 on SmolLM2: the probe ppl of each candidate
(the truncated model on the first Fisher window) against its evaluation on both corpora, paired
with the committed uniform / fisher runs. Needs the pipeline's work/ (gram, fisher, prepared model);
run from the repository root: .venv/bin/python benchmarks/experiments/rank_tilt.py
Measured rows: benchmarks/experiments/rank_tilt.jsonl."""
import glob
import json
import math

import torch
from safetensors.torch import load_file
import palu
from palu.data.corpora import load_corpus
from palu.data.windows import tokenize, evaluation_windows, bos_token_for
from palu.decompose.probe import truncated, probe_loss
from palu.decompose.ranks import allocate
from palu.decompose.spectra import whitened_svds, spectra_of
from palu.eval.stats import ppl_difference
from palu.models.adapters import geometry_of
torch.set_num_threads(1)
C = "work/calib/smollm2-135m/wiki_standin-n24-L2048-s0-float32/"
grams = load_file(C + "gram.safetensors")["gram"]
stats = load_file(C + "fisher-n8-L2048-s1/fisher.safetensors")
model, tok = palu.load_model("work/models/smollm2-135m", dtype="float32", device="cpu")
geom = geometry_of(model.config)
probe = palu.fisher_data(tok)[:1]
svds = whitened_svds(model, grams, 1)
spectra = spectra_of(svds)
bos = bos_token_for(tok, "auto")
ev = {c: evaluation_windows(tokenize(tok, load_corpus(c).evaluation_text), 2048, 4096, bos) for c in ("wiki_standin", "novels_standin")}
L = geom.num_layers
for kept in (0.3, 0.5):
    refs = {}
    for ref in ("uniform", "fisher"):
        for c in ev:
            f = glob.glob(f"results/runs/smollm2-135m/palu-whitened-{ref}-k{kept}-g1/*/*/ppl-{c}-L2048-T4096*.json")[0]
            refs[(ref, c)] = json.load(open(f))["metrics"]
    for t in (0.0, 1.0, 2.0, 3.0, 4.0):
        f = stats["output_fisher"].clone()
        for l in range(L):
            f[l] *= math.exp(t * (1 - l / (L - 1)))
        a = allocate(geom, kept, 1, "error_aware", 8, f, spectra)
        ks = sum(x["rank"] for x in a["ranks"] if x["kind"] == "k") / a["latent_size"]
        with truncated(model, svds, a):
            p = math.exp(probe_loss(model, probe))
            row = {"kept": kept, "tilt": t, "key_share": round(ks, 3), "probe_ppl": round(p, 2)}
            for c, w in ev.items():
                from palu.eval.perplexity import perplexity
                res = perplexity(model, w, progress=False)
                row[c] = round(res["ppl"], 2)
                for ref in ("uniform", "fisher"):
                    m = refs[(ref, c)]
                    d = ppl_difference(res["block_nll"], m["block_nll"], m["block_tokens"])
                    row[f"{c[:4]}-{ref}"] = f"{m['ppl']:.1f} d{d['diff']:+.1f}[{d['lo']:+.1f},{d['hi']:+.1f}]"
        print(json.dumps(row), flush=True)

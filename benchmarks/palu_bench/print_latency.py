"""Print a latency results JSON as a short table (used after GPU runs)."""
import json
import sys

d = json.load(open(sys.argv[1]))
print(d["device"], {k: f"{v:.3g}" for k, v in d["ceilings"].items()})
for r in d["rows"]:
    if "error" in r:
        print(f'{r["shape"]:10s} {r["length"]:6d} {r["variant"]:34s} ERROR {r["error"][:90]}')
        continue
    print(f'{r["shape"]:10s} {r["batch"]}x{r["length"]:<6d} {r["variant"]:34s} {r["seconds"]*1e6:8.1f}us '
          f'{r["tb_per_s"]:5.2f}TB/s {r["tflop_per_s"]:6.1f}TF roof {r["roofline_fraction"]:.2f} '
          f'x{r.get("speedup", 0):.2f}')
if d["checks"]:
    print("checks:", len(d["checks"]), "max rel err", max(c["rel_err"] for c in d["checks"]))

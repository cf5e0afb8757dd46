# GPU benchmarks. `latency` runs only where a CUDA GPU is visible (it fails clearly elsewhere);
# its JSON results are committed, so `latency_table` rebuilds the table on any machine.
LATENCY_JSON = sorted(str(p) for p in Path(R, "latency").glob("*.json") if "tune" not in p.name)
DECODE_JSON = sorted(str(p) for p in Path(R, "decode").glob("*.json"))
# Tables are default targets only where GPU results exist (committed ones for the default grid).
LATENCY_TARGETS = ([f"{R}/tables/latency.md"] if LATENCY_JSON else []) + (
    [f"{R}/tables/decode.md"] if DECODE_JSON else [])


rule latency:
    output:
        f"{R}/latency/{{device}}-{{shape}}.json",
    log:
        f"{W}/logs/latency/{{device}}-{{shape}}.log",
    shell:
        "{PY} -m palu.cli.latency out={output} shape={wildcards.shape} > {log} 2>&1"


rule latency_table:
    input:
        LATENCY_JSON,
    output:
        csv=f"{R}/tables/latency.csv",
        md=f"{R}/tables/latency.md",
        fig=f"{R}/figures/latency_speedup.png",
    log:
        f"{W}/logs/collect/latency.log",
    params:
        inputs=lambda w, input: ",".join(input),
    shell:
        "{PY} -m palu.cli.collect table=latency 'inputs=[{params.inputs}]' out={R}/tables/latency "
        "tracking=disabled > {log} 2>&1"


rule decode:
    output:
        f"{R}/decode/{{device}}-llama2-7b.json",
    log:
        f"{W}/logs/decode/{{device}}.log",
    shell:
        "{PY} -m palu.cli.decode out={output} > {log} 2>&1"


rule decode_table:
    input:
        DECODE_JSON,
    output:
        csv=f"{R}/tables/decode.csv",
        md=f"{R}/tables/decode.md",
        fig=f"{R}/figures/memory_vs_context.png",
    log:
        f"{W}/logs/collect/decode.log",
    params:
        inputs=lambda w, input: ",".join(input),
    shell:
        "{PY} -m palu.cli.collect table=decode 'inputs=[{params.inputs}]' out={R}/tables/decode "
        "tracking=disabled > {log} 2>&1"

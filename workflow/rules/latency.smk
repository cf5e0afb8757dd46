# GPU benchmarks (the palu_bench package beside the library). `latency` / `decode` run only
# where a CUDA GPU is visible (they fail clearly elsewhere); their JSON results are committed,
# so the table rules rebuild the tables and figures on any machine.
BENCH_TRACK = f"tracking.mode={GRID.tracking.mode} tracking.dir={GRID.tracking.dir}"
LATENCY_DIR, DECODE_DIR = naming.gpu_results_dir(R, "latency"), naming.gpu_results_dir(R, "decode")
SCALE_DIR = naming.gpu_results_dir(R, "scale")
LATENCY_JSON = sorted(str(p) for p in LATENCY_DIR.glob("*.json") if "tune" not in p.name)
DECODE_JSON = sorted(str(p) for p in DECODE_DIR.glob("*.json"))
SCALE_JSON = sorted(str(p) for p in SCALE_DIR.glob("*.json"))
THROUGHPUT_DIR = naming.gpu_results_dir(R, "throughput")
THROUGHPUT_JSON = sorted(str(p) for p in THROUGHPUT_DIR.glob("*.json"))
# the grid whose GPU-hours the scale table projects from the measured rates
PAPER_GRID = "conf/grid/paper.yaml"
# Tables are default targets only where GPU results exist (committed ones for the default grid).
LATENCY_TARGETS = ([str(naming.table_prefix(R, "latency")) + ".md"] if LATENCY_JSON else []) + (
    [str(naming.table_prefix(R, "decode")) + ".md"] if DECODE_JSON else []) + (
    [str(naming.table_prefix(R, "scale")) + ".md"] if SCALE_JSON else []) + (
    [str(naming.table_prefix(R, "throughput")) + ".md"] if THROUGHPUT_JSON else [])


localrules: latency_table, decode_table, scale_table, throughput_table


rule latency:
    output:
        str(LATENCY_DIR / "{device}-{shape}.json"),
    log:
        log("latency", "{device}-{shape}"),
    threads: threads_of("latency")
    resources: **needs("latency")
    shell:
        gpu_env("latency") + "exec {PY} -m palu_bench.cli.latency out={output} shape={wildcards.shape} {BENCH_TRACK} > {log} 2>&1"


rule latency_table:
    input:
        LATENCY_JSON,
    output:
        csv=str(naming.table_prefix(R, "latency")) + ".csv",
        md=str(naming.table_prefix(R, "latency")) + ".md",
        fig=str(naming.figure_path(R, "latency_speedup")),
    log:
        log("collect", "latency"),
    params:
        inputs=lambda w, input: ",".join(input),
        prefix=str(naming.table_prefix(R, "latency")),
    shell:
        "exec {PY} -m palu_bench.cli.table table=latency 'inputs=[{params.inputs}]' "
        "out={params.prefix} figure={output.fig} {BENCH_TRACK} > {log} 2>&1"


rule decode:
    output:
        str(DECODE_DIR / "{device}-llama2-7b.json"),
    log:
        log("decode", "{device}"),
    threads: threads_of("decode")
    resources: **needs("decode")
    shell:
        gpu_env("decode") + "exec {PY} -m palu_bench.cli.decode_e2e out={output} {BENCH_TRACK} > {log} 2>&1"


rule decode_table:
    input:
        DECODE_JSON,
    output:
        csv=str(naming.table_prefix(R, "decode")) + ".csv",
        md=str(naming.table_prefix(R, "decode")) + ".md",
        fig=str(naming.figure_path(R, "memory_vs_context")),
    log:
        log("collect", "decode"),
    params:
        inputs=lambda w, input: ",".join(input),
        prefix=str(naming.table_prefix(R, "decode")),
    shell:
        "exec {PY} -m palu_bench.cli.table table=decode 'inputs=[{params.inputs}]' "
        "out={params.prefix} figure={output.fig} {BENCH_TRACK} > {log} 2>&1"


# Paper scale (palu_bench.scale on a GPU host; one JSON per shape, and partial runs beside them,
# `<device>-<shape>-<what>.json`, made by hand with `steps=[...]`), and the paper grid's projected
# GPU-hours from its DAG at those rates (results/tables/scale.md)
rule scale:
    output:
        str(SCALE_DIR / "{device}-{shape}.json"),
    wildcard_constraints:
        device="[^-]+",
        shape="[a-z0-9]+-[0-9]+b",
    log:
        log("scale", "{device}-{shape}"),
    threads: threads_of("scale")
    resources: **needs("scale")
    shell:
        gpu_env("scale") + "exec {PY} -m palu_bench.cli.scale out={output} shape={wildcards.shape} {BENCH_TRACK} > {log} 2>&1"


rule scale_table:
    input:
        SCALE_JSON,
        PAPER_GRID,
    output:
        csv=str(naming.table_prefix(R, "scale")) + ".csv",
        md=str(naming.table_prefix(R, "scale")) + ".md",
        fig=str(naming.figure_path(R, "paper_gpu_hours")),
    log:
        log("collect", "scale"),
    params:
        inputs=",".join(SCALE_JSON),
        prefix=str(naming.table_prefix(R, "scale")),
    shell:
        "exec {PY} -m palu_bench.cli.table table=scale 'inputs=[{params.inputs}]' grid={PAPER_GRID} "
        "out={params.prefix} figure={output.fig} {BENCH_TRACK} > {log} 2>&1"


# Batched evaluation throughput (palu_bench.batch_throughput on a GPU host with the embedded model's
# weights staged there; its JSON committed under results/throughput/)
rule throughput_table:
    input:
        THROUGHPUT_JSON,
    output:
        csv=str(naming.table_prefix(R, "throughput")) + ".csv",
        md=str(naming.table_prefix(R, "throughput")) + ".md",
        fig=str(naming.figure_path(R, "throughput")),
    log:
        log("collect", "throughput"),
    params:
        inputs=lambda w, input: ",".join(input),
        prefix=str(naming.table_prefix(R, "throughput")),
    shell:
        "exec {PY} -m palu_bench.cli.table table=throughput 'inputs=[{params.inputs}]' "
        "out={params.prefix} figure={output.fig} {BENCH_TRACK} > {log} 2>&1"

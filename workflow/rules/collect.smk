# tables and figures from small result files: where Snakemake runs, never queued on a cluster
localrules: collect_table, rank_allocation_figure, cache_memory


rule collect_table:
    input:
        lambda w: GRID.table_inputs(w.table),
    output:
        csv=str(naming.table_prefix(R, "{table}")) + ".csv",
        md=str(naming.table_prefix(R, "{table}")) + ".md",
    wildcard_constraints:
        table="|".join(TABLES),
    log:
        log("collect", "{table}"),
    params:
        inputs=lambda w, input: ",".join(input),
        prefix=lambda w: str(naming.table_prefix(R, w.table)),
    shell:
        "exec {PY} -m palu.pipeline.cli.collect table={wildcards.table} 'inputs=[{params.inputs}]' "
        "out={params.prefix} {TRACK} > {log} 2>&1"


# the rank figure and the cache-memory table where the grid has their sections (the long-context
# grid has neither)
COLLECT_TARGETS = []
if GRID.figure_specs():
    COLLECT_TARGETS.append(str(naming.figure_path(R, "rank_allocation")))
if config.get("memory"):
    COLLECT_TARGETS.append(str(naming.table_prefix(R, "cache_memory")) + ".md")

if GRID.figure_specs():

    rule rank_allocation_figure:
        input:
            [GRID.ranks_file(s) for s in GRID.figure_specs()],
        output:
            str(naming.figure_path(R, "rank_allocation")),
        log:
            log("collect", "rank_figure"),
        params:
            inputs=lambda w, input: ",".join(input),
        shell:
            "exec {PY} -m palu.pipeline.cli.collect table=rank_figure 'inputs=[{params.inputs}]' out={output} "
            "{TRACK} > {log} 2>&1"


if config.get("memory"):

    rule cache_memory_run:
        input:
            lambda w: GRID.run_inputs(w.run),
        output:
            str(naming.memory_path(R, M, "{run}", config["memory"]["context"], config["memory"]["corpus"])),
        log:
            log("generate", "{run}"),
        params:
            method=lambda w: GRID.run_overrides(w.run),
            context=config["memory"]["context"],
            corpus=config["memory"]["corpus"],
        threads: threads_of("cache_memory_run")
        resources: **needs("cache_memory_run")
        shell:
            gpu_env("cache_memory_run") + "exec {PY} -m palu.pipeline.cli.generate {COMMON} {params.method} data={params.corpus} "
            "generate.context={params.context} out={output} progress=false "
            "> {log} 2>&1"


    rule cache_memory:
        input:
            GRID.memory_files(),
        output:
            csv=str(naming.table_prefix(R, "cache_memory")) + ".csv",
            md=str(naming.table_prefix(R, "cache_memory")) + ".md",
        log:
            log("collect", "cache_memory"),
        params:
            inputs=lambda w, input: ",".join(input),
            prefix=str(naming.table_prefix(R, "cache_memory")),
        shell:
            "exec {PY} -m palu.pipeline.cli.collect table=cache_memory 'inputs=[{params.inputs}]' "
            "out={params.prefix} {TRACK} > {log} 2>&1"

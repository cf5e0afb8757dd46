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
        tracking=config.get("tracking", "offline"),
    shell:
        "{PY} -m palu.cli.collect table={wildcards.table} 'inputs=[{params.inputs}]' "
        "out={params.prefix} tracking={params.tracking} paths.work={W} > {log} 2>&1"


rule rank_allocation_figure:
    input:
        GRID.ranks_file(GRID.figure_spec()),
    output:
        str(naming.figure_path(R, "rank_allocation")),
    log:
        log("collect", "rank_allocation"),
    shell:
        "{PY} -m palu.cli.collect table=rank_allocation 'inputs=[{input}]' out={output} "
        "tracking=disabled > {log} 2>&1"


rule cache_memory:
    input:
        model=MODEL_DIR,
        checkpoint=GRID.checkpoint(GRID.memory_spec()),
    output:
        json=str(naming.table_prefix(R, "cache_memory")) + ".json",
        md=str(naming.table_prefix(R, "cache_memory")) + ".md",
    log:
        log("collect", "cache_memory"),
    params:
        palu=GRID.decompose_overrides(GRID.memory_spec()),
        context=config["memory"]["context"],
    threads: workflow.cores
    shell:
        "{PY} -m palu.cli.generate {COMMON} {params.palu} method=palu "
        "method.checkpoint={input.checkpoint} data={config[memory][corpus]} "
        "generate.context={params.context} out={output.json} tracking=disabled progress=false "
        "> {log} 2>&1"

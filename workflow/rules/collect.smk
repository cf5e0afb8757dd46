rule collect_table:
    input:
        lambda w: GRID.table_inputs(w.table),
    output:
        csv=f"{R}/tables/{{table}}.csv",
        md=f"{R}/tables/{{table}}.md",
    wildcard_constraints:
        table="|".join(TABLES),
    log:
        f"{W}/logs/collect/{{table}}.log",
    params:
        inputs=lambda w, input: ",".join(input),
        tracking=config.get("tracking", "offline"),
    shell:
        "{PY} -m palu.cli.collect table={wildcards.table} 'inputs=[{params.inputs}]' "
        "out={R}/tables/{wildcards.table} tracking={params.tracking} paths.work={W} > {log} 2>&1"


rule rank_allocation_figure:
    input:
        GRID.ranks_file(GRID.figure_spec()),
    output:
        f"{R}/figures/rank_allocation.png",
    log:
        f"{W}/logs/collect/rank_allocation.log",
    shell:
        "{PY} -m palu.cli.collect table=rank_allocation 'inputs=[{input}]' out={output} "
        "tracking=disabled > {log} 2>&1"


rule cache_memory:
    input:
        model=f"{W}/models/{M}",
        checkpoint=lambda w: checkpoint_of(GRID.memory_wildcards()),
    output:
        json=f"{R}/tables/cache_memory.json",
        md=f"{R}/tables/cache_memory.md",
    log:
        f"{W}/logs/collect/cache_memory.log",
    params:
        palu=lambda w: palu_overrides(GRID.memory_wildcards()),
        context=config["memory"]["context"],
    threads: workflow.cores
    shell:
        "{PY} -m palu.cli.generate {COMMON} {params.palu} method=palu checkpoint={input.checkpoint} "
        "data={config[memory][corpus]} generate.context={params.context} out={output.json} "
        "tracking=disabled progress=false > {log} 2>&1"

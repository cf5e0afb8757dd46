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

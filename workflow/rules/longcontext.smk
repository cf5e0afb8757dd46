# Decode-time needle retrieval of the grid's `longcontext:` runs through their caches, the table
# pairing every method with FP16, and the depth x length heatmap.
LONGCONTEXT_TARGETS = []

if config.get("longcontext"):
    LONGCONTEXT_TARGETS = [str(naming.table_prefix(R, "longcontext")) + ".md",
                           str(naming.figure_path(R, "needle_heatmap"))]

    rule longcontext:
        input:
            lambda w: GRID.run_inputs(w.run),
        output:
            GRID.longcontext_pattern(),
        log:
            log("longcontext", "{run}"),
        benchmark:
            bench("longcontext", "{run}")
        threads: workflow.cores
        params:
            method=lambda w: GRID.run_overrides(w.run),
            suite=GRID.longcontext_overrides(),
        shell:
            "{PY} -m palu.cli.longcontext {COMMON} {params.method} {params.suite} out={output} "
            "progress=false > {log} 2>&1"

    rule longcontext_table:
        input:
            GRID.longcontext_files(),
        output:
            csv=str(naming.table_prefix(R, "longcontext")) + ".csv",
            md=str(naming.table_prefix(R, "longcontext")) + ".md",
        log:
            log("collect", "longcontext"),
        params:
            inputs=lambda w, input: ",".join(input),
            prefix=str(naming.table_prefix(R, "longcontext")),
        shell:
            "{PY} -m palu.cli.collect table=longcontext 'inputs=[{params.inputs}]' "
            "out={params.prefix} {TRACK} > {log} 2>&1"

    rule needle_heatmap:
        input:
            GRID.longcontext_files(),
        output:
            str(naming.figure_path(R, "needle_heatmap")),
        log:
            log("collect", "needle_heatmap"),
        params:
            inputs=lambda w, input: ",".join(input),
        shell:
            "{PY} -m palu.cli.collect table=needle_heatmap 'inputs=[{params.inputs}]' out={output} "
            "{TRACK} > {log} 2>&1"

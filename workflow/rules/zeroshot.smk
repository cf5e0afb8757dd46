# Zero-shot accuracy (lm-eval) of the grid's `zeroshot:` runs through their caches, and the table
# that pairs every method with FP16 on the same samples.
ZEROSHOT_TARGETS = []

if config.get("zeroshot"):
    ZEROSHOT_TARGETS = [str(naming.table_prefix(R, "zeroshot")) + ".md"]

    rule zeroshot:
        input:
            lambda w: GRID.run_inputs(w.run),
        output:
            GRID.zeroshot_pattern(),
        log:
            log("zeroshot", "{run}"),
        benchmark:
            bench("zeroshot", "{run}")
        # the longest per-run jobs start first, so the run does not end on one of them alone
        priority: 10
        threads: threads_of("zeroshot")
        resources: **needs("zeroshot")
        params:
            method=lambda w: GRID.run_overrides(w.run),
            zeroshot=GRID.zeroshot_overrides(),
        shell:
            gpu_env("zeroshot") + "exec {PY} -m palu.pipeline.cli.zeroshot {COMMON} {params.method} {params.zeroshot} out={output} "
            "progress=false > {log} 2>&1"

    localrules: zeroshot_table

    rule zeroshot_table:
        input:
            GRID.zeroshot_files(),
        output:
            csv=str(naming.table_prefix(R, "zeroshot")) + ".csv",
            md=str(naming.table_prefix(R, "zeroshot")) + ".md",
        log:
            log("collect", "zeroshot"),
        params:
            inputs=lambda w, input: ",".join(input),
            prefix=str(naming.table_prefix(R, "zeroshot")),
        shell:
            "exec {PY} -m palu.pipeline.cli.collect table=zeroshot 'inputs=[{params.inputs}]' "
            "out={params.prefix} {TRACK} > {log} 2>&1"

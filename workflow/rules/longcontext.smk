# Decode-time long-context evaluation of the grid's `longcontext:` runs through their caches, one
# job per run x suite (needles, qasper, longbench, ruler), the table pairing every method with FP16
# per task, and the needle depth x length heatmap.
LONGCONTEXT_TARGETS = []

if config.get("longcontext"):
    from palu.eval.suites import SUITES
    LONGCONTEXT_TARGETS = [str(naming.table_prefix(R, "longcontext")) + ".md"]
    if GRID.longcontext_files("needles"):
        LONGCONTEXT_TARGETS.append(str(naming.figure_path(R, "needle_heatmap")))
    if GRID.longcontext_files("ruler_style"):
        LONGCONTEXT_TARGETS += [str(naming.figure_path(R, "ruler_bytes")), str(naming.figure_path(R, "ruler_heatmap"))]

    rule longcontext:
        input:
            lambda w: GRID.run_inputs(w.run),
        output:
            GRID.longcontext_pattern(),
        wildcard_constraints:
            suite="|".join(re.escape(tag) for tag in GRID.longcontext_tags()),
        log:
            log("longcontext", "{run}/{suite}"),
        benchmark:
            bench("longcontext", "{run}/{suite}")
        # the longest per-run jobs start first, so the run does not end on one of them alone
        priority: 10
        threads: threads_of("longcontext")
        resources: **needs("longcontext")
        params:
            method=lambda w: GRID.run_overrides(w.run),
            suite=lambda w: GRID.longcontext_overrides(w.suite),
        shell:
            gpu_env("longcontext") + "exec {PY} -m palu.pipeline.cli.longcontext {COMMON} {params.method} {params.suite} out={output} "
            "progress=false > {log} 2>&1"

    # The prompts of the suites that keep them (RULER-style: ~5 min a job at 32K tokens), built
    # once on the CPU into the work folder's cache that every longcontext job reads (their key
    # checked there): `snakemake --configfile <grid> --cores 1 longcontext_prompts` before a GPU
    # lease, the folder carried with the lease (README, "Run on a GPU host without internet").
    # Not an input of the longcontext rule: a job without the cache builds its prompts itself.
    PROMPT_TAGS = [tag for tag, name in GRID.longcontext_tags().items() if SUITES[name].prompts]

    rule longcontext_prompts_built:
        input:
            MODEL_DIR,
        output:
            str(Path(W) / "prompts" / "{suite}.built.json"),
        wildcard_constraints:
            suite="|".join(re.escape(tag) for tag in PROMPT_TAGS) or "$^",
        log:
            log("longcontext", "prompts/{suite}"),
        params:
            suite=lambda w: GRID.longcontext_overrides(w.suite),
        shell:
            "exec {PY} -m palu.pipeline.cli.longcontext {COMMON} {params.suite} longcontext.prompts_only=true "
            "out={output} > {log} 2>&1"

    rule longcontext_prompts:
        input:
            [str(Path(W) / "prompts" / f"{tag}.built.json") for tag in PROMPT_TAGS],

    localrules: longcontext_table, needle_heatmap, ruler_figure, longcontext_prompts_built, longcontext_prompts

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
            "exec {PY} -m palu.pipeline.cli.collect table=longcontext 'inputs=[{params.inputs}]' "
            "out={params.prefix} {TRACK} > {log} 2>&1"

    rule needle_heatmap:
        input:
            GRID.longcontext_files("needles"),
        output:
            str(naming.figure_path(R, "needle_heatmap")),
        log:
            log("collect", "needle_heatmap"),
        params:
            inputs=lambda w, input: ",".join(input),
        shell:
            "exec {PY} -m palu.pipeline.cli.collect table=needle_heatmap 'inputs=[{params.inputs}]' out={output} "
            "{TRACK} > {log} 2>&1"

    # the RULER-style suite's accuracy against measured bytes, and its needle depth x length heatmap
    rule ruler_figure:
        input:
            GRID.longcontext_files("ruler_style"),
        output:
            str(naming.figure_path(R, "{figure}")),
        wildcard_constraints:
            figure="ruler_bytes|ruler_heatmap",
        log:
            log("collect", "{figure}"),
        params:
            inputs=lambda w, input: ",".join(input),
        shell:
            "exec {PY} -m palu.pipeline.cli.collect table={wildcards.figure} 'inputs=[{params.inputs}]' out={output} "
            "{TRACK} > {log} 2>&1"

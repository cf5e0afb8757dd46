# One rule for every method: the grid says what a run needs (`run_inputs`) and which Hydra
# overrides select its method (`run_overrides`); `run` is the method's tag.
rule evaluate:
    input:
        lambda w: GRID.run_inputs(w.run),
    output:
        GRID.evaluation_pattern(),
    log:
        log("evaluate", "{run}/" + Path(GRID.evaluation_pattern()).stem),
    benchmark:
        bench("evaluate", "{run}/" + Path(GRID.evaluation_pattern()).stem)
    threads: threads_of("evaluate")
    resources: **needs("evaluate")
    params:
        method=lambda w: GRID.run_overrides(w.run),
    shell:
        gpu_env("evaluate") + "exec {PY} -m palu.pipeline.cli.evaluate {COMMON} {params.method} data={wildcards.corpus} "
        "out={output} progress=false > {log} 2>&1"

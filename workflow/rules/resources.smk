rule prepare_model:
    output:
        directory(str(naming.prepared_model_dir(W, "{model}"))),
    log:
        log("prepare", "{model}"),
    benchmark:
        bench("prepare", "{model}")
    threads: threads_of("prepare_model")
    resources: **needs("prepare_model")
    shell:
        gpu_env("prepare_model") + "exec {PY} -m palu.pipeline.cli.prepare model={wildcards.model} paths.work={W} tracking={GRID.tracking.mode} out={output} > {log} 2>&1"

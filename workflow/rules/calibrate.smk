rule calibrate:
    input:
        MODEL_DIR,
    output:
        str(naming.gram_path(W, M, CTAG)),
    log:
        log("calibrate", f"{M}-{CTAG}"),
    benchmark:
        bench("calibrate", f"{M}-{CTAG}")
    threads: threads_of("calibrate")
    resources: **needs("calibrate")
    shell:
        gpu_env("calibrate") + "exec {PY} -m palu.pipeline.cli.calibrate {COMMON} out={output} progress=false > {log} 2>&1"


rule fisher:
    input:
        MODEL_DIR,
    output:
        str(naming.fisher_path(W, M, CTAG, FTAG)),
    log:
        log("fisher", f"{M}-{CTAG}-{FTAG}"),
    benchmark:
        bench("fisher", f"{M}-{CTAG}-{FTAG}")
    threads: threads_of("fisher")
    resources: **needs("fisher")
    shell:
        gpu_env("fisher") + "exec {PY} -m palu.pipeline.cli.fisher {COMMON} out={output} progress=false > {log} 2>&1"

rule calibrate:
    input:
        f"{W}/models/{M}",
    output:
        gram_file(),
    log:
        f"{W}/logs/calibrate/{M}-{CTAG}.log",
    benchmark:
        f"{W}/benchmarks/calibrate/{M}-{CTAG}.tsv"
    threads: workflow.cores
    shell:
        "{PY} -m palu.cli.calibrate {COMMON} out={output} progress=false > {log} 2>&1"


rule fisher:
    input:
        f"{W}/models/{M}",
    output:
        fisher_file(),
    log:
        f"{W}/logs/fisher/{M}-{CTAG}-{FTAG}.log",
    benchmark:
        f"{W}/benchmarks/fisher/{M}-{CTAG}-{FTAG}.tsv"
    threads: workflow.cores
    shell:
        "{PY} -m palu.cli.fisher {COMMON} out={output} progress=false > {log} 2>&1"

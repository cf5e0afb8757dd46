rule prepare_model:
    output:
        directory(f"{W}/models/{{model}}"),
    log:
        f"{W}/logs/prepare/{{model}}.log",
    benchmark:
        f"{W}/benchmarks/prepare/{{model}}.tsv"
    shell:
        "{PY} -m palu.cli.prepare model={wildcards.model} paths.work={W} out={output} > {log} 2>&1"

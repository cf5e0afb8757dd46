rule ranks_uniform:
    input:
        f"{W}/models/{M}",
    output:
        f"{W}/ranks/{M}/uniform-k{{kept}}-g{{group}}-m{MULT}.json",
    log:
        f"{W}/logs/ranks/uniform-k{{kept}}-g{{group}}.log",
    shell:
        "{PY} -m palu.cli.ranks {COMMON} palu.rank_method=uniform palu.kept_ratio={wildcards.kept} "
        "palu.group_size={wildcards.group} out={output} > {log} 2>&1"


rule ranks_fisher:
    input:
        f"{W}/models/{M}",
        fisher_file(),
    output:
        f"{W}/ranks/{M}/{CTAG}/{FTAG}/{{method}}-k{{kept}}-g{{group}}-m{MULT}.json",
    wildcard_constraints:
        method="fisher|fisher_uniform|fisher_sqrt",
    log:
        f"{W}/logs/ranks/{{method}}-k{{kept}}-g{{group}}.log",
    shell:
        "{PY} -m palu.cli.ranks {COMMON} palu.rank_method={wildcards.method} "
        "palu.kept_ratio={wildcards.kept} palu.group_size={wildcards.group} out={output} > {log} 2>&1"


rule decompose:
    input:
        model=f"{W}/models/{M}",
        gram=gram_file(),
        ranks=ranks_of,
    wildcard_constraints:
        ftag=f"no-fisher|{FTAG}",
    output:
        directory(f"{W}/palu/{M}/{CTAG}/{{ftag}}/palu-{{decomp}}-{{method}}-k{{kept}}-g{{group}}-m{MULT}"),
    log:
        f"{W}/logs/decompose/{{ftag}}-{{decomp}}-{{method}}-k{{kept}}-g{{group}}.log",
    benchmark:
        f"{W}/benchmarks/decompose/{{ftag}}-{{decomp}}-{{method}}-k{{kept}}-g{{group}}.tsv"
    threads: workflow.cores
    params:
        palu=palu_overrides,
    shell:
        "{PY} -m palu.cli.decompose {COMMON} {params.palu} out={output} progress=false > {log} 2>&1"

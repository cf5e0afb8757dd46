rule evaluate_fp16:
    input:
        f"{W}/models/{M}",
    output:
        f"{R}/runs/{M}/fp16/ppl-{{corpus}}-L{{seqlen}}-T{{tokens}}.json",
    log:
        f"{W}/logs/evaluate/fp16-{{corpus}}-L{{seqlen}}-T{{tokens}}.log",
    benchmark:
        f"{W}/benchmarks/evaluate/fp16-{{corpus}}-L{{seqlen}}-T{{tokens}}.tsv"
    threads: workflow.cores
    params:
        max_tokens=max_tokens,
    shell:
        "{PY} -m palu.cli.evaluate {COMMON} data={wildcards.corpus} data.seqlen={wildcards.seqlen} "
        "data.max_tokens={params.max_tokens} out={output} progress=false > {log} 2>&1"


rule evaluate_palu:
    input:
        model=f"{W}/models/{M}",
        checkpoint=checkpoint_of,
    output:
        f"{R}/runs/{M}/palu-{{decomp}}-{{method}}-k{{kept}}-g{{group}}/ppl-{{corpus}}-L{{seqlen}}-T{{tokens}}.json",
    log:
        f"{W}/logs/evaluate/palu-{{decomp}}-{{method}}-k{{kept}}-g{{group}}-{{corpus}}-L{{seqlen}}-T{{tokens}}.log",
    benchmark:
        f"{W}/benchmarks/evaluate/palu-{{decomp}}-{{method}}-k{{kept}}-g{{group}}-{{corpus}}-L{{seqlen}}-T{{tokens}}.tsv"
    threads: workflow.cores
    params:
        max_tokens=max_tokens,
        palu=palu_overrides,
    shell:
        "{PY} -m palu.cli.evaluate {COMMON} {params.palu} method=palu checkpoint={input.checkpoint} "
        "data={wildcards.corpus} data.seqlen={wildcards.seqlen} data.max_tokens={params.max_tokens} "
        "out={output} progress=false > {log} 2>&1"

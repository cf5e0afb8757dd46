# uniform and Fisher ranks read only the model's config and the Fisher scores (well under a second)
localrules: ranks_uniform, ranks_fisher

PALU = "palu.rank_method={wildcards.method} palu.kept_ratio={wildcards.kept} palu.group_size={wildcards.group}"


rule ranks_uniform:
    input:
        MODEL_DIR,
    output:
        str(naming.ranks_path(W, M, CTAG, FTAG, "uniform", "{kept}", "{group}", MULT)),
    log:
        log("ranks", "uniform-k{kept}-g{group}"),
    shell:
        "exec {PY} -m palu.pipeline.cli.ranks {COMMON} palu.rank_method=uniform palu.kept_ratio={wildcards.kept} "
        "palu.group_size={wildcards.group} out={output} > {log} 2>&1"


rule ranks_fisher:
    input:
        MODEL_DIR,
        str(naming.fisher_path(W, M, CTAG, FTAG)),
    output:
        str(naming.ranks_path(W, M, CTAG, FTAG, "{method}", "{kept}", "{group}", MULT)),
    wildcard_constraints:
        method="|".join(m for m in RANK_METHODS if m != "uniform" and m not in PROBED),
    log:
        log("ranks", "{method}-k{kept}-g{group}"),
    shell:
        "exec {PY} -m palu.pipeline.cli.ranks {COMMON} " + PALU + " out={output} > {log} 2>&1"


# error_aware spends ranks against each block's exact truncation error (the whitened spectrum
# of its weights on the calibration Gram) weighted by the loss's output Fisher; probe_select
# scores every allocator's ranks on a held-out probe window and keeps the best. Both run the model.
rule ranks_probed:
    input:
        MODEL_DIR,
        str(naming.fisher_path(W, M, CTAG, FTAG)),
        str(naming.gram_path(W, M, CTAG)),
    output:
        str(naming.ranks_path(W, M, CTAG, FTAG, "{method}", "{kept}", "{group}", MULT)),
    wildcard_constraints:
        method="|".join(PROBED),
    log:
        log("ranks", "{method}-k{kept}-g{group}"),
    threads: threads_of("ranks_probed")
    resources: **needs("ranks_probed")
    shell:
        "exec {PY} -m palu.pipeline.cli.ranks {COMMON} " + PALU + " out={output} > {log} 2>&1"


rule decompose:
    input:
        model=MODEL_DIR,
        gram=str(naming.gram_path(W, M, CTAG)),
        ranks=lambda w: GRID.ranks_file(spec_of(w)),
    wildcard_constraints:
        ftag=f"no-fisher|{FTAG}",
    output:
        directory(str(naming.checkpoint_dir(W, M, CTAG, "{ftag}", naming.palu_tag(
            "{decomp}", "{method}", "{kept}", "{group}", rotation="{rot}"), MULT, "{method}"))),
    log:
        log("decompose", "{ftag}-{decomp}-{method}-k{kept}-g{group}{rot}"),
    benchmark:
        bench("decompose", "{ftag}-{decomp}-{method}-k{kept}-g{group}{rot}")
    threads: threads_of("decompose")
    resources: **needs("decompose")
    params:
        palu=lambda w: GRID.decompose_overrides(spec_of(w)),
    shell:
        "exec {PY} -m palu.pipeline.cli.decompose {COMMON} {params.palu} out={output} progress=false > {log} 2>&1"


# LoRA recovery of a checkpoint (grid `recovery:`): the same ranks, A refined on calibration text
if config.get("recovery"):
    rule recover:
        input:
            model=MODEL_DIR,
            base=lambda w: GRID.checkpoint(spec_of(w)),
        wildcard_constraints:
            ftag=f"no-fisher|{FTAG}",
            rec=re.escape(GRID.recovery_tag()),
        output:
            directory(str(naming.checkpoint_dir(W, M, CTAG, "{ftag}", naming.palu_tag(
                "{decomp}", "{method}", "{kept}", "{group}", rotation="{rot}", recovery="{rec}"),
                MULT, "{method}"))),
        log:
            log("recover", "{ftag}-{decomp}-{method}-k{kept}-g{group}{rot}{rec}"),
        benchmark:
            bench("recover", "{ftag}-{decomp}-{method}-k{kept}-g{group}{rot}{rec}")
        threads: threads_of("recover")
        resources: **needs("recover")
        params:
            recovery=GRID.recovery_overrides(),
        shell:
            "exec {PY} -m palu.pipeline.cli.recover {COMMON} {params.recovery} recovery.checkpoint={input.base} "
            "out={output} progress=false > {log} 2>&1"

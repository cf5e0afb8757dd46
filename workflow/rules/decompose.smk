# uniform and Fisher ranks read only the model's config and the Fisher scores (well under a second)
localrules: ranks_uniform, ranks_fisher

# Every ranks file and checkpoint is looked up by its path in the grid (GRID.ranks_files(),
# GRID.checkpoints()): a path is a name, never parsed back into settings.
RANKS_ROOT, PALU_ROOT = str(naming.ranks_root(W, M)), str(naming.palu_root(W, M))


def ranks_names(kind):
    """The ranks files of one kind of allocator, as paths under RANKS_ROOT (a rule's wildcard)."""
    return "|".join(re.escape(os.path.relpath(path, RANKS_ROOT))
                    for path, spec in GRID.ranks_files().items() if allocator_kind(spec.rank_method) == kind) or "^$"


def ranks_spec(w):
    return GRID.ranks_files()[os.path.join(RANKS_ROOT, w.name)]


def checkpoint_names(recovered):
    return "|".join(re.escape(os.path.relpath(path, PALU_ROOT))
                    for path, spec in GRID.checkpoints().items() if bool(spec.recovery) == recovered) or "^$"


def checkpoint_spec(w):
    return GRID.checkpoints()[os.path.join(PALU_ROOT, w.name)]


rule ranks_uniform:
    input:
        MODEL_DIR,
    output:
        os.path.join(RANKS_ROOT, "{name}"),
    wildcard_constraints:
        name=ranks_names("uniform"),
    log:
        log("ranks", "{name}"),
    params:
        palu=lambda w: shell_join(ranks_spec(w).overrides()),
    shell:
        "exec {PY} -m palu.pipeline.cli.ranks {COMMON} {params.palu} out={output} > {log} 2>&1"


rule ranks_fisher:
    input:
        MODEL_DIR,
        str(naming.fisher_path(W, M, CTAG, FTAG)),
    output:
        os.path.join(RANKS_ROOT, "{name}"),
    wildcard_constraints:
        name=ranks_names("statistics"),
    log:
        log("ranks", "{name}"),
    params:
        palu=lambda w: shell_join(ranks_spec(w).overrides()),
    shell:
        "exec {PY} -m palu.pipeline.cli.ranks {COMMON} {params.palu} out={output} > {log} 2>&1"


# error_aware spends ranks against each block's exact truncation error (the whitened spectrum
# of its weights on the calibration Gram) weighted by the loss's output Fisher; probe_select
# scores every allocator's ranks on a held-out probe window and keeps the best. Both run the model.
rule ranks_probed:
    input:
        MODEL_DIR,
        str(naming.fisher_path(W, M, CTAG, FTAG)),
        str(naming.gram_path(W, M, CTAG)),
    output:
        os.path.join(RANKS_ROOT, "{name}"),
    wildcard_constraints:
        name=ranks_names("probed"),
    log:
        log("ranks", "{name}"),
    threads: threads_of("ranks_probed")
    resources: **needs("ranks_probed")
    params:
        palu=lambda w: shell_join(ranks_spec(w).overrides()),
    shell:
        gpu_env("ranks_probed") + "exec {PY} -m palu.pipeline.cli.ranks {COMMON} {params.palu} out={output} > {log} 2>&1"


rule decompose:
    input:
        model=MODEL_DIR,
        gram=str(naming.gram_path(W, M, CTAG)),
        ranks=lambda w: GRID.ranks_file(checkpoint_spec(w)),
    output:
        directory(os.path.join(PALU_ROOT, "{name}")),
    wildcard_constraints:
        name=checkpoint_names(recovered=False),
    log:
        log("decompose", "{name}"),
    benchmark:
        bench("decompose", "{name}")
    threads: threads_of("decompose")
    resources: **needs("decompose")
    params:
        palu=lambda w: shell_join(checkpoint_spec(w).overrides()),
    shell:
        gpu_env("decompose") + "exec {PY} -m palu.pipeline.cli.decompose {COMMON} {params.palu} out={output} progress=false > {log} 2>&1"


# LoRA recovery of a checkpoint (grid `recovery:`): the same ranks, A refined on calibration text
if config.get("recovery"):
    rule recover:
        input:
            model=MODEL_DIR,
            base=lambda w: GRID.checkpoint(checkpoint_spec(w).base()),
        output:
            directory(os.path.join(PALU_ROOT, "{name}")),
        wildcard_constraints:
            name=checkpoint_names(recovered=True),
        log:
            log("recover", "{name}"),
        benchmark:
            bench("recover", "{name}")
        threads: threads_of("recover")
        resources: **needs("recover")
        params:
            recovery=GRID.recovery_overrides(),
        shell:
            gpu_env("recover") + "exec {PY} -m palu.pipeline.cli.recover {COMMON} {params.recovery} "
            "recovery.checkpoint={input.base} out={output} progress=false > {log} 2>&1"

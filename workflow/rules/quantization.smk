# KVQuant's fitted codebooks (one state per bits / weighting), the ppl-vs-bytes and latent-outlier
# figures, and the per-method cache memory at a long prompt. The quantization table itself is
# the generic collect_table rule.
QUANT = config.get("quantization") or {}
# the figures are default targets where the grid has the quantization / hadamard tables
QUANT_FIGURES = ([str(naming.figure_path(R, "ppl_vs_bytes"))] if QUANT else []) + (
    [str(naming.figure_path(R, "latent_outliers"))] if GRID.outlier_checkpoints() else [])

if GRID.kvquant_specs():
    KVQ_ACTIVATIONS = str(naming.kvquant_activations_path(W, M, GRID.kvquant_ktag()))

    rule kvquant_capture:
        input:
            MODEL_DIR,
        output:
            KVQ_ACTIVATIONS,
        log:
            log("kvquant_capture", GRID.kvquant_ktag()),
        benchmark:
            bench("kvquant_capture", GRID.kvquant_ktag())
        threads: threads_of("kvquant_capture")
        resources: **needs("kvquant_capture")
        params:
            kv=GRID.kvquant_overrides(GRID.kvquant_specs()[0]),
        shell:
            "exec {PY} -m palu.pipeline.cli.kvquant_capture {COMMON} {params.kv} out={output} progress=false > {log} 2>&1"

    rule fit_kvquant:
        input:
            KVQ_ACTIVATIONS,
        output:
            directory(str(naming.kvquant_dir(W, M, GRID.kvquant_ktag(), "{state}"))),
        wildcard_constraints:
            state="|".join(re.escape(tag) for tag in GRID.kvquant_states()),
        log:
            log("fit_kvquant", "{state}"),
        benchmark:
            bench("fit_kvquant", "{state}")
        threads: threads_of("fit_kvquant")
        resources: **needs("fit_kvquant")
        params:
            kv=lambda w: GRID.kvquant_overrides(GRID.kvquant_states()[w.state]),
        shell:
            "exec {PY} -m palu.pipeline.cli.fit_kvquant {COMMON} {params.kv} kvquant.activations={input} "
            "out={output} progress=false > {log} 2>&1"


localrules: ppl_vs_bytes_figure


rule ppl_vs_bytes_figure:
    input:
        str(naming.table_prefix(R, "quantization")) + ".csv",
    output:
        str(naming.figure_path(R, "ppl_vs_bytes")),
    log:
        log("collect", "ppl_vs_bytes"),
    shell:
        "exec {PY} -m palu.pipeline.cli.collect table=ppl_vs_bytes 'inputs=[{input}]' out={output} "
        "{TRACK} > {log} 2>&1"


rule latent_outliers_figure:
    input:
        model=MODEL_DIR,
        checkpoints=GRID.outlier_checkpoints(),
    output:
        str(naming.figure_path(R, "latent_outliers")),
    log:
        log("collect", "latent_outliers"),
    params:
        inputs=lambda w, input: ",".join([input.model, *input.checkpoints]),
        corpus=QUANT.get("figure_corpus", "wiki_standin"),
    threads: threads_of("latent_outliers_figure")
    resources: **needs("latent_outliers_figure")
    shell:
        "exec {PY} -m palu.pipeline.cli.collect table=latent_outliers 'inputs=[{params.inputs}]' "
        "corpus={params.corpus} out={output} {TRACK} > {log} 2>&1"

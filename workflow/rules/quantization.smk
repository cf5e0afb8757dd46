# The ppl-vs-bytes and latent-outlier figures. The quantization table itself is the generic
# collect_table rule; KVQuant's codebooks are fitted by fitted.smk's rules.
QUANT = config.get("quantization") or {}
# the figures are default targets where the grid has the quantization / hadamard tables
QUANT_FIGURES = ([str(naming.figure_path(R, "ppl_vs_bytes"))] if QUANT else []) + (
    [str(naming.figure_path(R, "latent_outliers"))] if GRID.outlier_checkpoints() else [])

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
        gpu_env("latent_outliers_figure") + "exec {PY} -m palu.pipeline.cli.collect table=latent_outliers 'inputs=[{params.inputs}]' "
        "corpus={params.corpus} out={output} {TRACK} > {log} 2>&1"

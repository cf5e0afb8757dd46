# Palu pipeline. The grid (what to run) is conf/grid/default.yaml; another grid:
#   snakemake --cores 2 --configfile conf/grid/paper.yaml
# Rules only call Hydra entry points (python -m palu.pipeline.cli.<step>); see workflow/rules/.
# The default grid only when no other is given: Snakemake merges a --configfile over the
# workflow's own key by key, so the default's blocks (its hadamard, factors and recovery tables,
# its corpora) would otherwise leak into every other grid.
if not workflow.overwrite_configfiles:

    configfile: "conf/grid/default.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/resources.smk"
include: "workflow/rules/calibrate.smk"
include: "workflow/rules/decompose.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/collect.smk"
include: "workflow/rules/fitted.smk"
include: "workflow/rules/quantization.smk"
include: "workflow/rules/zeroshot.smk"
include: "workflow/rules/longcontext.smk"
include: "workflow/rules/latency.smk"


rule all:
    input:
        expand(str(naming.table_prefix(R, "{table}")) + ".{ext}", table=TABLES, ext=["csv", "md"]),
        COLLECT_TARGETS,
        QUANT_FIGURES,
        ZEROSHOT_TARGETS,
        LONGCONTEXT_TARGETS,
        LATENCY_TARGETS,

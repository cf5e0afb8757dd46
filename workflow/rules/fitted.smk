# Every fitted method of the grid (palu.pipeline.fitted: KVQuant's codebooks, one state per fit
# the grid lists): a capture of calibration activations that every state of the same windows is
# fitted from (rule <kind>_capture, where the method captures), and one fit per state (rule
# fit_<kind>, wildcard {state}: the state's tag). Nothing here names a method.
for KIND, FIT in GRID.fitted_kinds().items():
    WINDOWS = GRID.fitted_windows(FIT)
    FIT_INPUT = GRID.fitted_capture(FIT) if FIT.captures else MODEL_DIR

    if FIT.captures:
        rule:
            name: f"{KIND}_capture"
            input:
                MODEL_DIR,
            output:
                FIT_INPUT,
            log:
                log(f"{KIND}_capture", WINDOWS),
            benchmark:
                bench(f"{KIND}_capture", WINDOWS)
            threads: threads_of(f"{KIND}_capture")
            resources: **needs(f"{KIND}_capture")
            params:
                kind=KIND,
                settings=GRID.fitted_specs(KIND)[0].step_overrides(GRID),
            shell:
                gpu_env(f"{KIND}_capture") + "exec {PY} -m palu.pipeline.cli.capture fitted={params.kind} {COMMON} {params.settings} "
                "out={output} progress=false > {log} 2>&1"

    rule:
        name: f"fit_{KIND}"
        input:
            FIT_INPUT,
        output:
            directory(str(naming.fitted_dir(W, M, KIND, WINDOWS, "{state}"))),
        wildcard_constraints:
            state="|".join(re.escape(tag) for tag in GRID.fitted_states(KIND)),
        log:
            log(f"fit_{KIND}", "{state}"),
        benchmark:
            bench(f"fit_{KIND}", "{state}")
        threads: threads_of(f"fit_{KIND}")
        resources: **needs(f"fit_{KIND}")
        params:
            kind=KIND,
            settings=lambda w, kind=KIND: GRID.fitted_states(kind)[w.state].step_overrides(GRID),
            # the capture it fits from; a method that does not capture reads the model itself
            capture=lambda w, input, fit=FIT: (shell_join([f"{fit.kind}.{fit.capture_setting}={input[0]}"])
                                               if fit.captures else ""),
        shell:
            gpu_env(f"fit_{KIND}") + "exec {PY} -m palu.pipeline.cli.fit fitted={params.kind} {COMMON} {params.settings} "
            "{params.capture} out={output} progress=false > {log} 2>&1"

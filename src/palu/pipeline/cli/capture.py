"""Step `<kind>_capture` (`fitted=<kind>`): the calibration activations every state of a fitted
method on these windows is fitted from (`fit fitted=<kind> <kind>.activations=<out>`), captured
once: for KVQuant, pre-RoPE keys, values and their squared gradients, shared by all bit widths."""
from __future__ import annotations

from palu.models.loading import load_model
from palu.pipeline import naming
from palu.pipeline.cli.common import calibration_windows_of, check_window_length, entry_point, log, model_input, model_path, tracked
from palu.pipeline.fitted import fitted_kind


def run(cfg) -> str:
    spec = fitted_kind(cfg.fitted)
    settings = cfg[spec.kind]
    out = cfg.out or str(naming.fitted_capture_path(cfg.paths.work, cfg.model.name, spec.kind,
                                                    spec.windows_tag_of(cfg)))
    with tracked(cfg, f"{spec.kind}_capture", out, used=model_input(cfg)) as wb:
        captured = capture_of(cfg, spec, settings)
        captured.save(out)
        wb.metrics(spec.metrics(captured, settings))
        wb.make(f"{spec.kind}_activations", out, calibration_tag=captured.info["calibration_tag"])
    log.info("%s activations of %d tokens per layer -> %s", spec.kind, captured.info["tokens"], out)
    return out


def capture_of(cfg, spec, settings, for_state: bool = False):
    """The spec's capture on the calibration windows its settings draw (`samples`, `seqlen`,
    `seed`), recording the windows and the model it came from."""
    check_window_length(cfg, settings.seqlen, f"{spec.kind}.seqlen")
    model, tok = load_model(model_path(cfg), dtype=cfg.model.dtype, device=cfg.device)
    windows = calibration_windows_of(cfg, tok, settings.samples, settings.seqlen, settings.seed)
    info = {"calibration_tag": spec.windows_tag_of(cfg), "model": cfg.model.name,
            "corpus": cfg.calibration.corpus}
    return spec.capture(model, windows, settings, info, progress=cfg.progress, for_state=for_state)


main = entry_point(run)

if __name__ == "__main__":
    main()

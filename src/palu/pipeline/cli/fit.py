"""Step `fit_<kind>` (`fitted=<kind>`): one state of a fitted method (KVQuant's codebooks and key
channel ranges, from its `kvquant.*` settings) from a capture of calibration activations
(`<kind>.activations`, the capture step) or captured here; `method=<kind> method.state=<out>`
reads it."""
from __future__ import annotations

from palu.pipeline import naming
from palu.pipeline.cli.capture import capture_of
from palu.pipeline.cli.common import entry_point, log, model_input, tracked
from palu.pipeline.fitted import fitted_kind


def run(cfg) -> str:
    spec = fitted_kind(cfg.fitted)
    settings = cfg[spec.kind]
    captured_at = settings.get(spec.capture_setting)
    state_name = spec(**{k: settings[k] for k in spec.varied}).tag
    windows = spec.windows_tag_of(cfg)
    out = cfg.out or str(naming.fitted_dir(cfg.paths.work, cfg.model.name, spec.kind, windows, state_name))
    used = {f"{spec.kind}_activations": str(captured_at)} if captured_at else model_input(cfg)
    with tracked(cfg, f"fit_{spec.kind}", out, used=used) as wb:
        state = spec.fit(_captured(cfg, spec, settings, captured_at, windows), settings, device=cfg.device)
        state.save(out)
        wb.metrics(spec.metrics(state, settings))
        wb.make(f"{spec.kind}_state", out, tag=state.tag)
    log.info("%s %s fitted on %d tokens -> %s", spec.kind, state.tag, state.info["tokens"], out)
    return out


def _captured(cfg, spec, settings, captured_at, windows: str):
    """The capture this fit reads: the one given (refused if made on other `windows`), else its own."""
    if not captured_at:
        return capture_of(cfg, spec, settings, for_state=True)
    captured = spec.load_capture(str(captured_at))
    if captured.info.get("calibration_tag") != windows:
        raise ValueError(f"{spec.kind}.{spec.capture_setting}={captured_at} were captured on "
                         f"{captured.info.get('calibration_tag')!r}, not on the configured {windows!r}")
    return captured


main = entry_point(run)

if __name__ == "__main__":
    main()

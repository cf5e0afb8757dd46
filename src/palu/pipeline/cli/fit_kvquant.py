"""Step `fit_kvquant`: KVQuant's per-layer codebooks and key channel ranges (`kvquant.*`
settings), from a capture of calibration activations (`kvquant.activations`, the
kvquant_capture step) or captured here; `method=kvquant method.state=<out>` reads them."""
from __future__ import annotations

from palu.calib.kvquant import KVQuantActivations, capture_activations, fit_from_activations
from palu.models.loading import load_model
from palu.pipeline import naming
from palu.pipeline.cli.common import calibration_windows_of, entry_point, log, model_input, model_path, tracked


def run(cfg) -> str:
    k = cfg.kvquant
    out = cfg.out or str(naming.kvquant_dir_of(cfg))
    used = {"kvquant_activations": str(k.activations)} if k.activations else model_input(cfg)
    with tracked(cfg, "fit_kvquant", out, used=used) as wb:
        state = _fit(cfg)
        state.save(out)
        wb.metrics({"tokens": state.info["tokens"], "bits": k.bits})
        wb.make("kvquant_state", out, tag=state.tag)
    log.info("KVQuant %s fitted on %d tokens -> %s", state.tag, state.info["tokens"], out)
    return out


def _fit(cfg):
    k = cfg.kvquant
    if k.activations:
        captured = KVQuantActivations.load(k.activations)
        if captured.info.get("calibration_tag") != naming.kvquant_calibration_tag_of(cfg):
            raise ValueError(f"kvquant.activations={k.activations} were captured on "
                             f"{captured.info.get('calibration_tag')!r}, not on the configured "
                             f"{naming.kvquant_calibration_tag_of(cfg)!r}")
    else:
        model, tok = load_model(model_path(cfg), dtype=cfg.model.dtype, device=cfg.device)
        windows = calibration_windows_of(cfg, tok, k.samples, k.seqlen, k.seed)
        info = {"calibration_tag": naming.kvquant_calibration_tag_of(cfg), "model": cfg.model.name,
                "corpus": cfg.calibration.corpus}
        captured = capture_activations(model, windows, fisher=k.weighting == "fisher",
                                       tokens_per_window=k.tokens_per_window, seed=k.seed,
                                       progress=cfg.progress, info=info)
    return fit_from_activations(captured, k.bits, k.weighting, k.outlier_fraction, device=cfg.device)


main = entry_point(run)

if __name__ == "__main__":
    main()

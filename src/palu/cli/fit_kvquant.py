"""Step `fit_kvquant`: KVQuant's per-layer codebooks and key channel ranges, fitted on windows of
the calibration corpus (`kvquant.*` settings); `method=kvquant method.state=<out>` reads them."""
from __future__ import annotations

from ..methods.kvquant import fit_kvquant
from ..models.loading import load_model
from ..pipeline import naming
from .common import calibration_windows_of, entry_point, log, model_path


def run(cfg) -> str:
    k = cfg.kvquant
    out = cfg.out or str(naming.kvquant_dir_of(cfg))
    model, tok = load_model(model_path(cfg), dtype=cfg.model.dtype, device=cfg.device)
    windows = calibration_windows_of(cfg, tok, k.samples, k.seqlen, k.seed)
    info = {"calibration_tag": naming.kvquant_calibration_tag_of(cfg), "model": cfg.model.name,
            "corpus": cfg.calibration.corpus}
    state = fit_kvquant(model, windows, bits=k.bits, weighting=k.weighting,
                        outlier_fraction=k.outlier_fraction, tokens_per_window=k.tokens_per_window,
                        seed=k.seed, progress=cfg.progress, info=info)
    state.save(out)
    log.info("KVQuant %s fitted on %d tokens -> %s", state.tag, state.info["tokens"], out)
    return out


main = entry_point(run)

if __name__ == "__main__":
    main()

"""Step `calibrate`: Gram matrices of the K/V inputs per layer (cached per model + setting)."""
from __future__ import annotations

from safetensors.torch import save_file

from ..calib.gram import collect_grams
from ..io import atomic_path
from ..models.loading import load_model
from ..pipeline import naming
from .common import calibration_windows_of, entry_point, log, model_input, model_path, tracked


def run(cfg) -> str:
    c = cfg.calibration
    out = cfg.out or str(naming.gram_path_of(cfg))
    with tracked(cfg, "calibrate", out, used=model_input(cfg)) as wb:
        model, tok = load_model(model_path(cfg), dtype=cfg.model.dtype, device=cfg.device)
        windows = calibration_windows_of(cfg, tok, c.samples, c.seqlen, c.seed)
        stats = collect_grams(model, windows, progress=cfg.progress)
        with atomic_path(out) as tmp:
            save_file({"gram": stats["gram"].cpu()}, str(tmp),
                      metadata={"tokens": str(stats["tokens"]), "tag": naming.calibration_tag_of(cfg)})
        wb.metrics({"tokens": stats["tokens"]})
        wb.make("gram", out, tokens=stats["tokens"], tag=naming.calibration_tag_of(cfg))
    log.info("Gram over %d tokens -> %s", stats["tokens"], out)
    return out


main = entry_point(run)

if __name__ == "__main__":
    main()

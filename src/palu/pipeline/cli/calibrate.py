"""Step `calibrate`: Gram matrices of the K/V inputs per layer (cached per model + setting)."""
from __future__ import annotations

from palu.calib.gram import collect_grams
from palu.calib.stats_file import save_stats
from palu.models.loading import load_model
from palu.pipeline import naming
from palu.pipeline.cli.common import calibration_windows_of, check_window_length, entry_point, log, model_input, model_path, tracked


def run(cfg) -> str:
    c = cfg.calibration
    out = cfg.out or str(naming.gram_path_of(cfg))
    with tracked(cfg, "calibrate", out, used=model_input(cfg)) as wb:
        check_window_length(cfg, c.seqlen, "calibration.seqlen")
        model, tok = load_model(model_path(cfg), dtype=cfg.model.dtype, device=cfg.device)
        windows = calibration_windows_of(cfg, tok, c.samples, c.seqlen, c.seed)
        stats = collect_grams(model, windows, progress=cfg.progress)
        save_stats(out, {"gram": stats["gram"]}, {"tokens": stats["tokens"],
                                                  "tag": naming.calibration_tag_of(cfg)}, model)
        wb.metrics({"tokens": stats["tokens"]})
        wb.make("gram", out, tokens=stats["tokens"], tag=naming.calibration_tag_of(cfg))
    log.info("Gram over %d tokens -> %s", stats["tokens"], out)
    return out


main = entry_point(run)

if __name__ == "__main__":
    main()

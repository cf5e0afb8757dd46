"""Step `fisher`: squared-gradient importance of every K/V head (cached per model + setting)."""
from __future__ import annotations

from palu.calib.fisher import FISHER_STATS, collect_fisher
from palu.calib.stats_file import save_stats
from palu.models.loading import load_model
from palu.pipeline import naming
from palu.pipeline.cli.common import calibration_windows_of, check_window_length, entry_point, log, model_input, model_path, tracked


def run(cfg) -> str:
    f = cfg.fisher
    out = cfg.out or str(naming.fisher_path_of(cfg))
    with tracked(cfg, "fisher", out, used=model_input(cfg)) as wb:
        check_window_length(cfg, f.seqlen, "fisher.seqlen")
        model, tok = load_model(model_path(cfg), dtype=cfg.model.dtype, device=cfg.device)
        windows = calibration_windows_of(cfg, tok, f.samples, f.seqlen, f.seed)
        stats = collect_fisher(model, windows, progress=cfg.progress)
        save_stats(out, {k: stats[k] for k in FISHER_STATS},
                   {"windows": stats["windows"], "tag": naming.fisher_tag_of(cfg)}, model)
        wb.metrics({"windows": stats["windows"]})
        wb.make("fisher", out, windows=stats["windows"], tag=naming.fisher_tag_of(cfg))
    log.info("Fisher over %d windows -> %s", stats["windows"], out)
    return out


main = entry_point(run)

if __name__ == "__main__":
    main()

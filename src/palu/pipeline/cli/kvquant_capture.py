"""Step `kvquant_capture`: the calibration activations (pre-RoPE keys, values and their squared
gradients) that every KVQuant state of these windows is fitted from (`fit_kvquant
kvquant.activations=<out>`): one backward pass per window, shared by all bit widths."""
from __future__ import annotations

from palu.calib.kvquant import capture_activations
from palu.models.loading import load_model
from palu.pipeline import naming
from palu.pipeline.cli.common import calibration_windows_of, check_window_length, entry_point, log, model_input, model_path, tracked


def run(cfg) -> str:
    k = cfg.kvquant
    out = cfg.out or str(naming.kvquant_activations_path_of(cfg))
    with tracked(cfg, "kvquant_capture", out, used=model_input(cfg)) as wb:
        check_window_length(cfg, k.seqlen, "kvquant.seqlen")
        model, tok = load_model(model_path(cfg), dtype=cfg.model.dtype, device=cfg.device)
        windows = calibration_windows_of(cfg, tok, k.samples, k.seqlen, k.seed)
        info = {"calibration_tag": naming.kvquant_calibration_tag_of(cfg), "model": cfg.model.name,
                "corpus": cfg.calibration.corpus}
        captured = capture_activations(model, windows, fisher=True,
                                       tokens_per_window=k.tokens_per_window, seed=k.seed,
                                       progress=cfg.progress, info=info)
        captured.save(out)
        wb.metrics({"tokens": captured.info["tokens"]})
        wb.make("kvquant_activations", out, calibration_tag=info["calibration_tag"])
    log.info("KVQuant activations of %d tokens per layer -> %s", captured.info["tokens"], out)
    return out


main = entry_point(run)

if __name__ == "__main__":
    main()

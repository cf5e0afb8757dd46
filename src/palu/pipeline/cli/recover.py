"""Step `recover`: LoRA recovery of a Palu checkpoint (palu.recover.lora), saved as a checkpoint
of the same ranks whose tag adds the recovery settings."""
from __future__ import annotations

import copy
from pathlib import Path

from palu.pipeline.config import to_dict
from palu.decompose.checkpoint import load_compressed, save_compressed
from palu.models.loading import load_model
from palu.pipeline import naming
from palu.recover import LoraRecovery, factors_of, recover
from palu.pipeline.cli.common import calibration_windows_of, entry_point, log, model_input, model_path, tracked


def run(cfg) -> str:
    r = cfg.recovery
    if not r.checkpoint:
        raise ValueError("recovery.checkpoint=<Palu checkpoint folder> is required")
    if not Path(r.checkpoint).is_dir():
        raise FileNotFoundError(f"recovery.checkpoint={r.checkpoint!r} is not a checkpoint folder")
    settings = LoraRecovery(rank=r.rank, steps=r.steps, lr=r.lr, init_scale=r.init_scale, seed=r.seed)
    settings.check()
    if not cfg.out:
        raise ValueError("out=<folder> is required (the recovered checkpoint)")
    used = {**model_input(cfg), "checkpoint": str(r.checkpoint)}
    with tracked(cfg, "recover", cfg.out, used=used) as wb:
        teacher, tok = load_model(model_path(cfg), dtype=cfg.model.dtype, device=cfg.device)
        model = copy.deepcopy(teacher)
        manifest = load_compressed(model, r.checkpoint)
        windows = calibration_windows_of(cfg, tok, r.samples, r.seqlen, r.seed)
        report = recover(model, teacher, windows, settings, progress=cfg.progress)
        tag = manifest["tag"] + naming.recovery_tag_of(cfg)
        out_manifest = {**manifest, "tag": tag, "recovery": report,
                        "settings": {**manifest["settings"], "recovery": to_dict(r)},
                        "summary": {**manifest["summary"], "recovery": naming.recovery_tag_of(cfg)}}
        save_compressed(cfg.out, factors_of(model), out_manifest)
        wb.metrics({"kl_first": report["kl_first"], "kl_last": report["kl_last"],
                    "recover_seconds": report["seconds"]})
        wb.make("checkpoint", cfg.out, tag=tag)
    log.info("%s: KL %.4f -> %.4f in %d steps (%.0f s) -> %s", tag, report["kl_first"], report["kl_last"],
             r.steps, report["seconds"], cfg.out)
    return cfg.out


main = entry_point(run)

if __name__ == "__main__":
    main()

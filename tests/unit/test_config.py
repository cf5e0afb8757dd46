"""Every config in conf/ composes and validates; bad values fail naming the key."""
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from palu.pipeline.config import CONF_DIR, ConfigError, method_defaults, register, to_dict, validate

register()

GROUPS = ["model", "method", "data", "calibration", "fisher", "palu", "generate", "zeroshot",
          "longcontext", "tracking", "paths"]


def _compose(overrides=()):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture(scope="module")
def fitted_states(tmp_path_factory):
    """A state folder for every fitted method (its `method.state`)."""
    from palu.pipeline.fitted import FITTED
    from tiny import fitted_state, tiny_llama
    return {kind: fitted_state(kind, tiny_llama(0), tmp_path_factory.mktemp(kind) / "state") for kind in FITTED}


def _options(group):
    """A group's options: its files in conf/ (but the `base` they extend) and what the schema
    stored in Hydra's ConfigStore (`<group>/default`, one `method/<name>` per method)."""
    from hydra.core.config_store import ConfigStore
    stored = ConfigStore.instance().repo.get(group, {})
    files = {p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml")}
    return sorted((files | {name.removesuffix(".yaml") for name in stored}) - {"base"})


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_of_every_group_composes_and_validates(group, fitted_states):
    options = _options(group)
    assert options
    needs = {"palu": ["method.checkpoint=ckpt"], "palu_select": ["method.checkpoint=ckpt"],
             "palu_snapkv": ["method.checkpoint=ckpt"], "palu_tova": ["method.checkpoint=ckpt"],
             **{kind: [f"method.state={state}"] for kind, state in fitted_states.items()}}
    for option in options:
        # a method that needs a checkpoint / fitted state gets one; every other group composes as it is
        extra = needs.get(option, []) if group == "method" else []
        cfg = validate(_compose([f"{group}={option}", *extra]))
        # the option's own values arrive in the validated config
        path = Path(CONF_DIR) / group / f"{option}.yaml"
        own = (OmegaConf.to_container(OmegaConf.load(path)) if path.is_file()
               else method_defaults(option) if group == "method" else {})
        for key, value in own.items():
            if key != "defaults" and value is not None and not str(value).startswith(("???", "${")):
                assert cfg[group][key] == value, (group, option, key)


def test_a_fitted_methods_settings_come_from_its_spec_and_take_overrides():
    """A fitted method's settings group (`kvquant.*`) is its spec's dataclass (palu.pipeline.fitted),
    with no line of conf/: defaults from the dataclass, overrides checked by the spec."""
    from palu.pipeline.fitted import FITTED
    from palu.pipeline.specs import defaults_of
    cfg = validate(_compose())
    assert set(FITTED) == {"kvquant", "kivi_vscale"} and cfg.fitted is None
    for kind, spec in FITTED.items():
        assert OmegaConf.to_container(cfg[kind]) == defaults_of(spec.settings)
    assert validate(_compose(["fitted=kvquant", "kvquant.bits=4"])).kvquant.bits == 4
    with pytest.raises(ConfigError, match="kvquant.tokens_per_window=0 must be a positive integer"):
        validate(_compose(["kvquant.tokens_per_window=0"]))
    with pytest.raises(ConfigError, match=r"fitted='atom' is not one of \['kivi_vscale', 'kvquant'\]"):
        validate(_compose(["fitted=atom"]))


def test_no_group_restates_the_schema():
    """The schema's dataclasses are the one home of every default: no conf/<group>/default.yaml,
    no method YAML (a method's options are its dataclass fields)."""
    from palu.methods import method_names
    assert [p.parent.name for p in Path(CONF_DIR).glob("*/default.yaml")] == ["grid"]   # a grid, not a group
    assert not (Path(CONF_DIR) / "method").exists()
    assert set(_options("method")) == set(method_names())
    cfg = validate(_compose())
    assert cfg.zeroshot.limit == 20 and cfg.tracking.dir == "work/wandb"
    assert validate(_compose(["paths.work=/tmp/w"])).tracking.dir == "/tmp/w/wandb"


@pytest.mark.parametrize("override, key", [
    ("palu.kept_ratio=0", "palu.kept_ratio"),
    ("palu.kept_ratio=1.2", "palu.kept_ratio"),
    ("data.seqlen=0", "data.seqlen"),
    ("data.seqlen=-5", "data.seqlen"),
    ("palu.rank_method=fishr", "palu.rank_method"),
    ("palu.rank_method=search-e0", "palu.rank_method: rank method 'search-e0' is not one of"),
    ("palu.rank_method=search-e400", "spells out a default"),
    ("tracking.mode=sometimes", "tracking.mode"),
    ("method=palu", "method.checkpoint"),
    (["method=palu", "method.checkpoint=x", "method.latent_bits=5"], "method.latent_bits"),
    (["method=palu", "method.checkpoint=x", "+method.bits=4"], "'bits' is now 'latent_bits'"),
    ("device=gpu", "device"),
    ("longcontext.suite=babilong", "longcontext.suite"),
    ("longcontext.qasper.limit=0", "longcontext.qasper.limit"),
    ("longcontext.needles.lengths=[0]", "longcontext.needles.lengths"),
    (["longcontext.suite=longbench", "longcontext.longbench.dir=/nonexistent"], "missing LongBench files"),
    (["longcontext.suite=longbench"], "longcontext.longbench.dir is not set"),
    (["longcontext.suite=ruler", "longcontext.ruler.dir=/nonexistent"], "missing RULER files"),
    ("longcontext.qasper.max_length=0", "longcontext.qasper.max_length"),
])
def test_out_of_range_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(_compose(override if isinstance(override, list) else [override]))


def test_misspelled_keys_fail():
    with pytest.raises(Exception, match="seqln"):
        _compose(["data.seqln=128"])
    cfg = _compose()
    from omegaconf import OmegaConf
    raw = OmegaConf.to_container(cfg)
    raw["palu"]["kept_ratoi"] = 0.5  # a typo inside a YAML file reaches validate() like this
    with pytest.raises(ConfigError, match="kept_ratoi"):
        validate(raw)


def test_grids_parse():
    from palu.pipeline.grid import Grid
    for path in (Path(CONF_DIR) / "grid").glob("*.yaml"):
        grid = Grid.load(path)
        assert grid.common_overrides()
        # a grid with a rank_allocation section plans its runs (long-context and zero-shot-only
        # grids have none)
        assert grid.rank_allocation_specs() or not grid.config.get("rank_allocation"), path.stem
    with pytest.raises(ValueError, match="unknown grid keys"):
        Grid({"model": "x", "calibration": {}, "fisher": {}, "typo": 1})


def test_a_grid_dtype_reaches_every_step_and_every_tag():
    """`dtype: float16` (a GPU grid) is given to every step and named in every path, so a
    float16 result never lands where a float32 one of the same settings lies."""
    from palu.pipeline.grid import Grid
    raw = yaml.safe_load((Path(CONF_DIR) / "grid" / "default.yaml").read_text())
    plain, half = Grid(raw), Grid({**raw, "dtype": "float16"})
    assert "model.dtype=float16" in half.common_overrides()
    assert not any(o.startswith("model.dtype") for o in plain.common_overrides())
    assert "float16" in half.ctag and "float32" in plain.ctag
    assert set(half.zeroshot_files()).isdisjoint(plain.zeroshot_files())
    assert set(half.longcontext_files()).isdisjoint(plain.longcontext_files())
    with pytest.raises(ValueError, match="grid dtype='half'"):
        Grid({**raw, "dtype": "half"})


def test_palu_latent_widths_are_latent_bits_and_the_old_key_is_refused_by_the_new_name(monkeypatch):
    """Issue 52 item 4: `bits` is a quantiser's code width; Palu's latent width is `latent_bits`
    in every grid section and entry that sets one. The old key anywhere Palu reads a width fails
    naming the new one, never silently taking 16."""
    from palu.pipeline.grid import Grid
    monkeypatch.setattr(Grid, "kv_heads", lambda self: 3)
    raw = yaml.safe_load((Path(CONF_DIR) / "grid" / "default.yaml").read_text())
    grid = Grid(raw)
    assert sorted({s.latent_bits for s in grid.latent_bits_specs()}) == [2, 3, 4, 8, 16]
    assert {s.latent_bits for s in grid.memory_runs().values() if hasattr(s, "latent_bits")} == {16, 3}
    old = {
        "latent_bits": {**raw["latent_bits"], "bits": raw["latent_bits"]["latent_bits"]},
        "hadamard": {**raw["hadamard"], "bits": [4]},
        "memory": {**raw["memory"], "bits": [16]},
        "byte_budget": {**raw["byte_budget"], "budgets": [{"kept_ratio": 0.5, "bits": 4}]},
        "quantization": {**raw["quantization"], "palu": {**raw["quantization"]["palu"], "bits": [4]}},
        "rank_allocation": {**raw["rank_allocation"], "bits": [4]},
        "zeroshot": {**raw["zeroshot"], "palu": [{"kept_ratio": 0.5, "group_size": 1, "bits": 3}]},
    }
    calls = {"latent_bits": "latent_bits_specs", "hadamard": "hadamard_specs", "memory": "memory_runs",
             "byte_budget": "byte_budget_specs", "quantization": "quantization_palu_specs",
             "rank_allocation": "rank_allocation_specs", "zeroshot": "zeroshot_runs"}
    for key, section in old.items():
        bad = Grid({**raw, key: section})
        bad.__dict__["geometry"] = None   # the cached property unread (setattr would read it first)
        with pytest.raises(ValueError, match=r"\.bits=.*is now `latent_bits`"):
            getattr(bad, calls[key])()
    # a quantiser's width keeps its word: the same grid's baselines say `bits`
    assert all("bits" in m for m in raw["quantization"]["baselines"])


# issue 21's tables as default.yaml describes them (commented out there until their results land)
FACTORS = {"kept_ratios": [0.5], "group_sizes": [1, "kv_heads"], "decompositions": ["whitened", "attention"],
           "rank_method": "uniform", "corpora": ["wiki_standin"]}
RECOVERY = {"runs": [{"kept_ratio": 0.5, "group_size": 1}, {"kept_ratio": 0.5, "group_size": "kv_heads"}],
            "rank": 8, "steps": 16, "lr": 0.001, "samples": 16, "seqlen": 256, "corpora": ["wiki_standin"]}


def _grid_with_issue21_tables():
    from palu.pipeline.grid import Grid
    raw = yaml.safe_load((Path(CONF_DIR) / "grid" / "default.yaml").read_text())
    return Grid({**raw, "factors": FACTORS, "recovery": RECOVERY})


def test_the_factors_ablation_grid(monkeypatch):
    from palu.pipeline.grid import Grid
    grid = _grid_with_issue21_tables()
    monkeypatch.setattr(Grid, "kv_heads", lambda self: 3)
    specs = grid.factors_specs()
    assert {(s.decomposition, s.group_size) for s in specs} == {
        ("whitened", 1), ("attention", 1), ("whitened", 3), ("attention", 3)}
    assert "factors" in grid.tables() and len(grid.table_runs("factors")) == 5
    bad = Grid({**grid.config, "factors": {**grid.config["factors"], "decompositions": ["whitened", "attenton"]}})
    with pytest.raises(ValueError, match="attenton"):
        bad.factors_specs()


def test_the_recovery_grid(monkeypatch):
    from palu.pipeline.grid import Grid
    grid = _grid_with_issue21_tables()
    monkeypatch.setattr(Grid, "kv_heads", lambda self: 3)
    specs = grid.recovery_specs()
    assert [s.recovery for s in specs] == ["", grid.recovery_tag()] * 2
    assert specs[1].tag == specs[0].tag.replace("-g1", "-g1" + grid.recovery_tag())
    assert grid.checkpoint(specs[1]) != grid.checkpoint(specs[0])
    bad = Grid({**grid.config, "recovery": {**grid.config["recovery"], "stesp": 3}})
    with pytest.raises(ValueError, match="stesp"):
        bad.recovery_specs()


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt", "mistral", "gemma3_text", "qwen3", "olmo2",
                                    "phi3", "gemma2", "gpt2"])
def test_geometry_from_config_json_equals_transformers(tmp_path, family):
    """The workflow plans from a folder's config.json read as JSON (no transformers import): it
    gives the Geometry transformers' own config does, and refuses the same families (Gemma-2 by
    its soft-capping, GPT-2 for want of an adapter)."""
    import transformers as tf
    from palu.models.adapters import UnsupportedArchitectureError, geometry_of
    from palu.models.loading import load_config, load_geometry
    small = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    config = {"llama": lambda: tf.LlamaConfig(**{**small, "num_hidden_layers": 3}, num_key_value_heads=2, head_dim=32),
              "qwen2": lambda: tf.Qwen2Config(**{**small, "num_attention_heads": 8}, num_key_value_heads=2),
              "opt": lambda: tf.OPTConfig(**small, ffn_dim=96, word_embed_proj_dim=64),
              "mistral": lambda: tf.MistralConfig(**small, num_key_value_heads=4),
              "gemma3_text": lambda: tf.Gemma3TextConfig(**small, num_key_value_heads=1, head_dim=16),
              "qwen3": lambda: tf.Qwen3Config(**small, num_key_value_heads=2, head_dim=32),
              "olmo2": lambda: tf.Olmo2Config(**small, num_key_value_heads=2),
              "phi3": lambda: tf.Phi3Config(**small, num_key_value_heads=2),
              "gemma2": lambda: tf.Gemma2Config(**small, num_key_value_heads=2, head_dim=16),
              "gpt2": lambda: tf.GPT2Config(n_embd=64, n_head=4, n_layer=2)}[family]()
    config.save_pretrained(tmp_path)
    if family in ("gemma2", "gpt2"):
        for load in (load_geometry, load_config):
            with pytest.raises(UnsupportedArchitectureError, match="softcapping" if family == "gemma2" else "'gpt2'"):
                load(str(tmp_path))
        return
    assert load_geometry(str(tmp_path)) == geometry_of(load_config(str(tmp_path)))


def test_job_resources_defaults_overrides_and_errors():
    """Each model job's scheduler request: the device's defaults, the grid's values, a step's
    own; a GPU on cuda except for the CPU-only prepare step, always for the GPU benchmarks."""
    from palu.pipeline.jobs import job_resources, scheduler_resources
    assert job_resources(None, "cpu", "evaluate").threads == 1
    assert scheduler_resources(None, "cpu", "evaluate") == {"mem_mb": 6000, "runtime": 60}
    grid = {"threads": 4, "mem_mb": 32000, "zeroshot": {"runtime": 720}}
    assert job_resources(grid, "cuda", "zeroshot").runtime == 720
    assert job_resources(grid, "cuda", "evaluate").runtime == 240
    assert scheduler_resources(grid, "cuda", "evaluate") == {"mem_mb": 32000, "runtime": 240, "gpu": 1}
    assert "gpu" not in scheduler_resources(grid, "cuda", "prepare_model")
    assert scheduler_resources(None, "cpu", "latency")["gpu"] == 1
    # Snakemake's --config 'resources={threads: 2}' delivers text
    assert job_resources({"threads": "2", "zeroshot": {"runtime": "90"}}, "cuda", "zeroshot").runtime == 90
    for bad, match in (({"treads": 2}, "treads"), ({"threads": 0}, "threads"),
                       ({"evaluate": {"mem": 1}}, "evaluate"), ({"mem_mb": "64G"}, "mem_mb")):
        with pytest.raises(ValueError, match=match):
            job_resources(bad, "cuda", "evaluate")
    with pytest.raises(ValueError, match="tpu"):
        job_resources(None, "tpu", "evaluate")


def test_grid_refuses_the_old_thread_key():
    from palu.pipeline.grid import Grid
    with pytest.raises(ValueError, match="resources.threads"):
        Grid({"model": "x", "calibration": {}, "fisher": {}, "job_threads": 2})


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible here")
def test_device_cuda_without_a_gpu_fails_before_any_work():
    from palu.models.loading import check_device, load_model
    check_device("cpu")
    with pytest.raises(RuntimeError, match=r"device=cuda but no CUDA device is available: .*Run on a cluster"):
        load_model("/nonexistent/folder", device="cuda")


def test_grid_sections_are_settings_over_the_schema():
    """A grid section is the step's settings over its schema dataclass: a typo fails naming the
    key, what the section leaves out is the schema's default (no third copy of defaults), and
    the overrides the rules pass are generated from the merged settings."""
    from palu.eval.needles import NeedlesSettings
    from palu.pipeline.config import ZeroshotConfig
    from palu.pipeline.grid import Grid
    raw = yaml.safe_load((Path(CONF_DIR) / "grid" / "default.yaml").read_text())
    grid = Grid(raw)
    assert grid.zeroshot_settings()["seed"] == ZeroshotConfig().seed
    needles = grid.longcontext_suites()["needles"]
    assert needles["max_new_tokens"] == NeedlesSettings().max_new_tokens
    assert "'longcontext.needles.lengths=[1024,2048]'" in grid.longcontext_overrides(
        next(t for t, n in grid.longcontext_tags().items() if n == "needles")).split()
    for section, typo in (("calibration", "sampels"), ("fisher", "sed"), ("eval", "seqln")):
        with pytest.raises(ValueError, match=f"grid {section} has unknown keys \\['{typo}'\\]"):
            Grid({**raw, section: {**raw[section], typo: 1}})
    bad = {**raw, "zeroshot": {**raw["zeroshot"], "limt": 3}}
    with pytest.raises(ValueError, match="limt"):
        Grid(bad).zeroshot_settings()
    # every checkpoint and ranks file is found by its path, none parsed back
    ck = grid.checkpoints()
    assert all(grid.checkpoint(spec) == path for path, spec in ck.items())
    assert all(grid.ranks_file(spec) == path for path, spec in grid.ranks_files().items())


def test_each_step_records_the_groups_it_reads_and_no_other():
    """A result's record and its W&B config say what made it: decompose carries calibration,
    fisher and palu but not zeroshot; an evaluating step carries its method, not palu.*."""
    from palu.pipeline.cli.common import STEP_GROUPS, config_of
    cfg = _compose()
    every = {k for k, v in to_dict(cfg).items() if isinstance(v, dict)}
    for step, groups in STEP_GROUPS.items():
        assert set(groups) <= every, step
        recorded = {k for k, v in config_of(cfg, step).items() if isinstance(v, dict)}
        assert recorded == {"model", "paths", "tracking", *groups}, step
        assert config_of(cfg, step)["seed"] == cfg.seed, step      # top-level settings always
    assert config_of(cfg, "some_new_step") == to_dict(cfg)           # unlisted: everything


def test_the_long_pilot_grid_runs_the_long_grids_methods():
    """conf/grid/long_pilot.yaml is long.yaml at fewer prompts: the same methods, or its numbers
    would pilot something else."""
    long, pilot = (yaml.safe_load((Path(CONF_DIR) / "grid" / f"{name}.yaml").read_text())
                   for name in ("long", "long_pilot"))
    assert long["longcontext"]["palu"] == pilot["longcontext"]["palu"]
    assert long["longcontext"]["baselines"] == pilot["longcontext"]["baselines"]
    assert {k: v for k, v in long.items() if k not in ("results", "longcontext")} == \
        {k: v for k, v in pilot.items() if k not in ("results", "longcontext")}


@pytest.mark.parametrize("key, value", [("work", "$(touch {marker})"), ("results", "results two"),
                                        ("eval.corpora", ["wiki_standin;touch {marker}"]),
                                        ("longcontext.suites.qasper.limit", "`touch {marker}`")])
def test_a_grid_value_that_a_shell_would_read_is_refused_before_any_job(tmp_path, key, value):
    """Issue 51, item 7: grid values become arguments of `shell:` steps. A value with `$(...)`,
    backticks, `;` or a space is refused when the grid is read (Snakemake's plan stops with the
    key named, nothing runs); the overrides are quoted for the shell besides."""
    import subprocess
    import sys
    from palu.pipeline.grid import Grid
    from palu.pipeline.specs import shell_join
    marker = tmp_path / "ran"
    grid = yaml.safe_load((Path(CONF_DIR) / "grid" / "small.yaml").read_text())
    node, *path, leaf = [grid, *key.split(".")]
    for part in path:
        node = node.setdefault(part, {})
    node[leaf] = [v.format(marker=marker) for v in value] if isinstance(value, list) else value.format(marker=marker)
    import re
    with pytest.raises(ValueError, match=re.escape(f"grid.{key}") + ".*a grid value may hold only"):
        Grid(grid)
    if key != "work":   # Snakemake's plan reads the grid through `Grid` (above): one run shows it stops
        return
    conf = tmp_path / "grid.yaml"
    conf.write_text(yaml.safe_dump(grid))
    root = Path(CONF_DIR).resolve().parent
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1", "-n", "--configfile", str(conf)],
                          cwd=root, capture_output=True, text=True)
    assert proc.returncode != 0 and "a grid value may hold only" in proc.stdout + proc.stderr
    assert not marker.exists()
    assert shell_join(["data.corpus=$(touch x)", "a b", "zeroshot.tasks=[piqa,arc_easy]"]) == \
        "'data.corpus=$(touch x)' 'a b' 'zeroshot.tasks=[piqa,arc_easy]'"


def test_batch_sizes_reach_the_steps_only_where_a_grid_sets_them():
    """A batch size says how a step runs, not what it computes: a grid without one gives no job a
    new parameter (Snakemake would rerun every job whose params changed); one that sets it passes
    it to the steps (evaluate: eval.batch_size, zeroshot, longcontext)."""
    from palu.pipeline.grid import Grid
    grid = yaml.safe_load((Path(CONF_DIR) / "grid" / "default.yaml").read_text())
    plain = Grid(grid)
    assert not any("batch_size" in x for x in plain.common_overrides())
    assert "batch_size" not in plain.zeroshot_overrides()
    assert all("batch_size" not in plain.longcontext_overrides(t) for t in plain.longcontext_tags())
    grid["eval"]["batch_size"] = 16
    grid["zeroshot"]["batch_size"] = "auto"
    grid["longcontext"]["batch_size"] = 64
    batched = Grid(grid)
    assert "data.batch_size=16" in batched.common_overrides()
    assert "zeroshot.batch_size=auto" in batched.zeroshot_overrides()
    assert all("longcontext.batch_size=64" in batched.longcontext_overrides(t) for t in batched.longcontext_tags())


def test_a_search_budget_is_a_rank_method_variant():
    assert validate(_compose(["palu.rank_method=search-e800-w8"])).palu.rank_method == "search-e800-w8"

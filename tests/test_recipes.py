"""docs/recipes.md against the presets: every row's "ours" value is what the preset resolves to, as a run
resolves it (load_config, the DeepSpeed JSON through resolve_deepspeed_config, for the ranks the section
names, on a GPU with native bf16), every key a preset file sets has a row, and `train --dry-run` prints
the same resolution. A preset or the table changed alone fails here."""

import json
import re
from pathlib import Path

import pytest

from eva_fastclip.cli import main
from eva_fastclip.config import ExperimentConfig, LossConfig, load_config
from eva_fastclip.plan.deepspeed_json import load_deepspeed_config
from eva_fastclip.plan.precision import (
    Hardware,
    detect_hardware,
)
from eva_fastclip.plan.run_plan import make_plan

REPO = Path(__file__).parents[1]
RECIPES = REPO / "docs" / "recipes.md"
BF16_GPU = Hardware(cuda=True, native_bf16=True, description="a GPU with native bf16")
WEIGHT_KEYS = ("pretrained", "vision_checkpoint", "text_checkpoint")


def sections() -> dict[str, dict]:
    """Each "## `configs/X.json`" or "## Loss defaults: `name`" section: its ranks and its table rows."""
    found = {}
    for block in re.split(r"^## ", RECIPES.read_text(), flags=re.M)[1:]:
        title = block.splitlines()[0]
        preset = re.match(r"`configs/(\w+)\.json`", title)
        loss = re.match(r"Loss defaults: `(\w+)`", title)
        if not (preset or loss):
            continue
        rows = []
        for line in block.splitlines():
            if not line.startswith("| `"):
                continue
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            assert len(cells) == 5, line  # key | reference | source | ours | why
            key, ours = cells[0].strip("`"), cells[3]
            assert ours.startswith("`") and ours.endswith("`"), line
            rows.append((key, json.loads(ours[1:-1])))
        ranks = re.search(r"Resolved for\s+\*\*(\d+) ranks\*\*", block)
        name = preset.group(1) if preset else f"loss:{loss.group(1)}"
        found[name] = {"rows": rows, "ranks": int(ranks.group(1)) if ranks else None}
    return found


SECTIONS = sections()
PRESETS = sorted(name for name in SECTIONS if not name.startswith("loss:"))


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A launch directory with the repository's ds_configs/ and an empty file at every weight path a preset
    names (ModelConfig checks that they are files; nothing reads them here)."""
    (tmp_path / "ds_configs").symlink_to(REPO / "ds_configs")
    for path in REPO.glob("configs/*.json"):
        model = json.loads(path.read_text()).get("model", {})
        for key in WEIGHT_KEYS:
            if model.get(key):
                (tmp_path / model[key]).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / model[key]).touch()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def resolve(preset: str, ranks: int, hardware: Hardware) -> dict:
    """The experiment config and the DeepSpeed JSON as `eva-fastclip train` resolves them: the run plan's
    (plan/run_plan.py), for GPUs elsewhere (no input file checked)."""
    cfg = load_config(REPO / "configs" / f"{preset}.json")
    ds = load_deepspeed_config(cfg.train.deepspeed_config)
    plan = make_plan(cfg, ds, world_size=ranks, hardware=hardware, inputs=False)
    return {"experiment": cfg.to_dict(), "deepspeed": plan.deepspeed}


def lookup(resolved: dict, key: str):
    section, *path = key.split(".")
    node = resolved["deepspeed"] if section == "deepspeed" else resolved["experiment"][section]
    for part in path:
        assert isinstance(node, dict) and part in node, f"{key}: no such resolved key"
        node = node[part]
    return json.loads(json.dumps(node))  # tuples as lists, as the table's JSON has them


def leaf_keys(tree: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in tree.items():
        if isinstance(value, dict):
            keys += leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.append(prefix + key)
    return keys


def test_every_preset_has_a_table():
    presets = {p.stem for p in REPO.glob("configs/*.json") if not p.stem.startswith("toy")}
    assert presets == set(PRESETS)
    assert {"loss:fastclip_v3", "loss:fastclip_v2", "loss:isogclr", "loss:siglip"} <= SECTIONS.keys()


@pytest.mark.parametrize("preset", PRESETS)
def test_table_matches_the_resolved_preset(preset, run_dir):
    section = SECTIONS[preset]
    assert section["ranks"], f"docs/recipes.md: the {preset} section names no 'Resolved for **N ranks**'"
    resolved = resolve(preset, section["ranks"], BF16_GPU)
    wrong = {
        key: (ours, lookup(resolved, key)) for key, ours in section["rows"] if ours != lookup(resolved, key)
    }
    assert not wrong, f"docs/recipes.md says (ours, resolved): {wrong}"
    keys = [key for key, _ in section["rows"]]
    assert len(keys) == len(set(keys)), "a key has two rows"


@pytest.mark.parametrize("preset", PRESETS)
def test_a_preset_runs_its_global_batch_on_any_number_of_ranks(preset, run_dir):
    """The global batch is the recipe: on 4, 8 and 32 ranks the DeepSpeed JSON gets the same
    train_batch_size, each rank holds at most train.max_micro_batch pairs in a forward pass, and the
    accumulation makes up the rest."""
    cfg = load_config(REPO / "configs" / f"{preset}.json")
    assert cfg.train.global_batch is not None, f"configs/{preset}.json states no train.global_batch"
    for ranks in (4, 8, 32):
        resolved = resolve(preset, ranks, BF16_GPU)["deepspeed"]
        micro, accum = resolved["train_micro_batch_size_per_gpu"], resolved["gradient_accumulation_steps"]
        assert resolved["train_batch_size"] == cfg.train.global_batch == micro * accum * ranks, ranks
        assert micro <= cfg.train.max_micro_batch, ranks
        # no more micro-batches than the bound needs: the micro-batch is the share, or near the bound
        share = cfg.train.global_batch // ranks
        assert accum == 1 if share <= cfg.train.max_micro_batch else micro * 2 > cfg.train.max_micro_batch


@pytest.mark.parametrize("preset", PRESETS)
def test_every_key_a_preset_sets_has_a_row(preset):
    raw = json.loads((REPO / "configs" / f"{preset}.json").read_text())
    rows = {key for key, _ in SECTIONS[preset]["rows"]}
    missing = sorted(set(leaf_keys(raw)) - rows)
    assert not missing, f"configs/{preset}.json sets {missing}, which docs/recipes.md does not list"


@pytest.mark.parametrize("name", ["fastclip_v3", "fastclip_v2", "isogclr", "siglip"])
def test_loss_defaults_match_their_table(name):
    resolved = {"experiment": ExperimentConfig(loss=LossConfig(name=name)).to_dict(), "deepspeed": {}}
    wrong = {
        key: (ours, lookup(resolved, key))
        for key, ours in SECTIONS[f"loss:{name}"]["rows"]
        if ours != lookup(resolved, key)
    }
    assert not wrong, f"docs/recipes.md says (ours, resolved): {wrong}"


def test_dry_run_resolves_as_the_table_is_checked(run_dir, capsys):
    """`train --dry-run --world-size N` prints the resolution the tests above check (the presets' data is
    not here, so the pre-flight check fails after printing it)."""
    for preset in PRESETS:
        ranks = SECTIONS[preset]["ranks"]
        argv = ["train", "--config", str(REPO / "configs" / f"{preset}.json"), "--dry-run"]
        main([*argv, "--world-size", str(ranks)])
        out = capsys.readouterr().out
        printed = json.loads(out[out.index("{") :])
        expected = resolve(preset, ranks, detect_hardware())
        assert printed["experiment"] == json.loads(json.dumps(expected["experiment"])), preset
        assert printed["deepspeed"] == json.loads(json.dumps(expected["deepspeed"])), preset
        assert printed["global_batch"] == expected["deepspeed"]["train_batch_size"], preset

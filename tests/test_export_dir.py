"""Export to open_clip's own folder through the command line and the checks before the folder appears: a
path without .pt gives a folder that replaces only an earlier export; a folder open_clip would not load, or
whose model computes something else than the trained one, never appears. That the folder loads in a Python
without eva_fastclip and gives the trained embeddings is tests/launched/test_export_isolated.py's."""

import json

import pytest
from export_cases import train_case

from eva_fastclip import cli, export


@pytest.fixture(scope="module")
def trained(request, tmp_path_factory):
    """The case of export_cases.CASES that a test names (indirect parametrisation), trained one step."""
    return train_case(request.param, tmp_path_factory.mktemp(request.param))


def printed_summary(capsys) -> dict:
    out = capsys.readouterr().out  # DeepSpeed's zero_to_fp32 prints before the command's JSON
    return json.loads(out[out.rfind("{\n") :])


@pytest.mark.parametrize("trained", ["toy-vit"], indirect=True)  # the same for every model
def test_cli_writes_a_folder_for_a_path_without_pt_and_replaces_only_an_earlier_export(trained, capsys):
    tmp, checkpoint = trained["tmp"], str(trained["checkpoint"])
    folder = tmp / "cli" / "model"
    assert cli.main(["export", "--checkpoint", checkpoint, "--output", str(folder)]) == 0
    assert printed_summary(capsys)["format"] == "open_clip folder"
    written = (folder / "open_clip_model.safetensors").stat().st_mtime_ns
    assert cli.main(["export", "--checkpoint", checkpoint, "--output", str(folder)]) == 0  # replaced
    assert (folder / "open_clip_model.safetensors").stat().st_mtime_ns >= written
    assert sorted(p.name for p in folder.parent.iterdir()) == ["model"]  # no .tmp or .old left

    other = tmp / "cli" / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert cli.main(["export", "--checkpoint", checkpoint, "--output", str(other)]) == 2
    assert "no earlier export" in capsys.readouterr().err
    assert sorted(p.name for p in other.iterdir()) == ["keep.txt"]

    assert cli.main(["export", "--checkpoint", checkpoint, "--output", str(tmp / "cli" / "model.pt")]) == 0
    assert printed_summary(capsys)["format"] == "state dict"


@pytest.mark.parametrize("trained", ["tiny-eva"], indirect=True)
def test_a_folder_that_open_clip_would_not_load_never_appears(trained, monkeypatch):
    import open_clip

    build = open_clip.create_model

    def refuse(name, *args, **kwargs):  # the export's own model builds; its folder does not load
        if name.startswith("local-dir:"):
            raise RuntimeError(f"open_clip would not load {name}")
        return build(name, *args, **kwargs)

    monkeypatch.setattr(open_clip, "create_model", refuse)
    with pytest.raises(RuntimeError, match="would not load local-dir:"):
        export.export_open_clip(trained["checkpoint"], trained["tmp"] / "refused" / "model")
    assert list((trained["tmp"] / "refused").iterdir()) == []  # neither the folder nor its .tmp


@pytest.mark.parametrize("trained", ["tiny-eva"], indirect=True)
def test_a_folder_whose_model_computes_something_else_never_appears(trained, monkeypatch):
    from eva_fastclip.models import eva

    # without RoPE the stand-in trunk has the same tensors (its tables are not saved) but other outputs
    base, args = eva.TIMM_STANDINS["eva02_test_xs_patch8_clip_32"]
    wrong = (base, dict(args, use_rot_pos_emb=False))
    monkeypatch.setitem(eva.TIMM_STANDINS, "eva02_test_xs_patch8_clip_32", wrong)
    with pytest.raises(ValueError, match="differs from the trained one in encode_image"):
        export.export_open_clip(trained["checkpoint"], trained["tmp"] / "wrong" / "model")
    assert list((trained["tmp"] / "wrong").iterdir()) == []

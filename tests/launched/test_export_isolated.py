"""Export to open_clip's own folder: a trained model (the shipped toy ViT, the tiny EVA-02, a Hugging Face
text tower) loads with ``open_clip.create_model_and_transforms("local-dir:DIR")`` and ``get_tokenizer`` in a
Python that cannot import eva_fastclip and has no network (a process of its own: ``python -I``),
preprocesses an image and tokenizes a caption as training did, gives the trained model's embeddings, and
goes through open_clip's Hugging Face Hub push. The command line and the refusals:
tests/test_export_dir.py.

One such process loads the three exports one after another (a new interpreter costs ~10 s of imports on
this machine); it checks after each that nothing of eva_fastclip was imported or registered."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from export_cases import CASES, train_case
from PIL import Image

from eva_fastclip import export
from eva_fastclip.config import ModelConfig
from eva_fastclip.models import create_model

CAPTION = "a photo of a red square on a blue background"

# Runs with `python -I` (no script folder, no PYTHONPATH on sys.path) and a finder ahead of the editable
# install's that refuses eva_fastclip, so nothing it registers (architectures, timm trunks) is known here.
CLEAN_LOADER = r"""
import importlib, importlib.abc, importlib.util, json, shutil, socket, sys
from pathlib import Path


class NoEvaFastclip(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "eva_fastclip":
            raise ImportError(f"{name}: this process must do without eva_fastclip")


def no_network(*args, **kwargs):
    raise OSError("no network here")


sys.meta_path.insert(0, NoEvaFastclip())
socket.socket.connect = socket.create_connection = no_network

import huggingface_hub, open_clip, timm, torch
from PIL import Image

hub = importlib.import_module("open_clip.push_to_hf_hub")  # the package's push_to_hf_hub is the function
real_hf_tokenizer = hub.HFTokenizer


class OfflineTokenizer(hub.HFTokenizer):  # the hub tokenizer it swaps in for CLIP's own BPE one
    def __init__(self, name):
        pass

    def save_pretrained(self, dest):
        pass


def readme_missing(url):
    raise hub.EntryNotFoundError(url)


# open_clip 3.3 imports repo_type_and_id_from_hf_id, which huggingface_hub 2 no longer has, and so none of
# its hub names: they are supplied here, the ones that would reach the network as stand-ins
hub.EntryNotFoundError, hub.hf_hub_url = huggingface_hub.errors.EntryNotFoundError, huggingface_hub.hf_hub_url
hub.repo_type_and_id_from_hf_id = lambda url: (None, *url.split("/")[-2:])
hub.create_repo = lambda repo_id, **kwargs: f"https://huggingface.co/{repo_id}"
hub.list_repo_files = no_network
hub.get_hf_file_metadata = readme_missing


def load(folder, image_path, caption, out):
    name = f"local-dir:{folder}"
    # as clip_benchmark's --model local-dir:DIR calls it (its --pretrained default is ignored for a local-dir)
    model, _, preprocess = open_clip.create_model_and_transforms(
        name, pretrained="laion400m_e32", cache_dir=None
    )
    tokenizer = open_clip.get_tokenizer(name)
    model.eval()
    pixels, tokens = preprocess(Image.open(image_path)).unsqueeze(0), tokenizer([caption])
    result = {"pixels": pixels, "tokens": tokens, "tokenizer": type(tokenizer).__name__}
    with torch.no_grad():
        image, text = model.encode_image(pixels), model.encode_text(tokens)
    result.update(image=image, text=text, scale=model.logit_scale)

    # open_clip's push to the Hugging Face Hub, its network calls replaced: the folder it uploads loads again
    pushed = Path(out).parent / "pushed"
    hub.upload_folder = lambda folder_path, **kwargs: shutil.copytree(folder_path, pushed)
    hub.HFTokenizer = real_hf_tokenizer  # (not an earlier case's stand-in)
    if not isinstance(tokenizer, hub.HFTokenizer):
        hub.HFTokenizer = OfflineTokenizer
    hub.push_pretrained_to_hf_hub(name, pretrained=None, repo_id="someone/model")  # its command line's call
    result["pushed_files"] = sorted(p.name for p in pushed.iterdir())
    # the upload must stand alone: the exported folder is gone where someone downloads it
    shutil.move(folder, folder + ".elsewhere")
    try:
        again = open_clip.create_model(f"local-dir:{pushed}").eval()
        with torch.no_grad():
            result.update(pushed_image=again.encode_image(pixels), pushed_text=again.encode_text(tokens))
    except Exception as err:
        result["pushed_error"] = repr(err)
    shutil.move(folder + ".elsewhere", folder)

    try:
        importlib.util.find_spec("eva_fastclip")
    except ImportError:
        result["blocked"] = True
    result["modules"] = sorted(m for m in sys.modules if m.partition(".")[0] == "eva_fastclip")
    eva_trunk = timm.is_model("eva02_test_xs_patch8_clip_32")
    result["registered"] = ["toy-vit-t" in open_clip.list_models(), eva_trunk]
    torch.save(result, out)


for case in json.loads(sys.argv[1]):
    load(*case)
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every case trained and exported (the toy ViT's folder then moved: nothing in it names a path), an
    image written beside it; then one process without eva_fastclip loads every export."""
    cases, jobs = {}, []
    for case in CASES:
        trained = train_case(case, tmp_path_factory.mktemp(case))
        tmp = trained["tmp"]
        folder = tmp / "export" / "model"
        summary = export.export_open_clip(trained["checkpoint"], folder)
        entry = {
            **trained,
            "summary": summary,
            "staging_left": (tmp / "export" / "model.tmp").exists(),
            "config": json.loads((folder / "open_clip_config.json").read_text()),
            "files": {p.name for p in folder.iterdir()},
            "exported_to": folder,
        }
        if case == "toy-vit":
            folder = Path(shutil.move(folder, tmp / "moved"))
        image_path = tmp / "image.png"
        rng = np.random.default_rng(0)
        Image.fromarray(rng.integers(0, 256, (80, 96, 3), dtype=np.uint8)).save(image_path)
        cases[case] = {**entry, "folder": folder, "image_path": image_path}
        jobs.append([str(folder), str(image_path), CAPTION, str(tmp / "clean.pt")])
    run_without_eva_fastclip(jobs, tmp_path_factory.mktemp("clean"))
    for entry in cases.values():
        entry["clean"] = torch.load(entry["tmp"] / "clean.pt", weights_only=False)
    return cases


def run_without_eva_fastclip(jobs: list[list[str]], work: Path) -> None:
    """One ``python -I`` process runs CLEAN_LOADER on every job (folder, image, caption, output file)."""
    script = work / "load.py"
    script.write_text(CLEAN_LOADER)
    proc = subprocess.run(
        [sys.executable, "-I", str(script), json.dumps(jobs)],
        cwd=work,  # not the repository: nothing of it on sys.path
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("case", list(CASES))
def test_exported_folder_loads_without_eva_fastclip_and_gives_the_trained_embeddings(exported, case):
    trained = exported[case]
    folder, image_path, clean = trained["folder"], trained["image_path"], trained["clean"]
    config = trained["config"]
    assert trained["summary"] == {
        "output": str(trained["exported_to"]),
        "format": "open_clip folder",
        "architecture": trained["cfg"].model.name,
        "tensors": len(trained["model"].state_dict()),
    }
    assert not trained["staging_left"]
    assert set(config) == {"model_cfg", "preprocess_cfg"}
    files = trained["files"]
    assert {"open_clip_config.json", "open_clip_model.safetensors"} <= files
    if case == "tiny-eva":
        assert config["model_cfg"]["vision_cfg"]["timm_model_name"] == f"local-dir:{folder}/vision_trunk"
    if case == "hf-text":
        assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    assert clean["blocked"] and clean["modules"] == [] and clean["registered"] == [False, False]

    # what training saw: the bundle's eval preprocessing and tokenizer, and the trained weights
    model_cfg = trained["cfg"].model
    bundle = create_model(ModelConfig(name=model_cfg.name, text_hf_model=model_cfg.text_hf_model))
    pixels = bundle.preprocess_eval(Image.open(image_path)).unsqueeze(0)
    tokens = bundle.tokenizer([CAPTION])
    torch.testing.assert_close(clean["pixels"], pixels, rtol=0, atol=0)
    torch.testing.assert_close(clean["tokens"], tokens, rtol=0, atol=0)
    assert clean["tokenizer"] == ("HFTokenizer" if case == "hf-text" else "SimpleTokenizer")
    model = trained["model"]
    with torch.no_grad():
        image, text = model.encode_image(pixels), model.encode_text(tokens)
    compared = [("image", image), ("text", text)]
    if case == "toy-vit":  # self-contained: the upload loads without the exported folder
        assert "pushed_error" not in clean
        compared += [("pushed_image", image), ("pushed_text", text)]
    else:  # the documented limit (docs/checkpoints.md): its config names the exported folder's own path
        assert str(folder) in clean["pushed_error"]
    for key, ours in compared:
        # relative to the features' size: the tiny EVA's are ~1e-4 (its head init is scaled by 1e-3)
        torch.testing.assert_close(clean[key], ours, rtol=1e-5, atol=1e-6 * ours.abs().max().item())
    torch.testing.assert_close(clean["scale"], model.logit_scale.detach().reshape(()))
    assert {"open_clip_config.json", "open_clip_model.safetensors"} <= set(clean["pushed_files"])

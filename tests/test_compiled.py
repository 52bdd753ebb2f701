"""``train.compile`` (engine/compiled.py), one rank in this process, fp32, 50% masking: the compiled towers
take the eager run's steps (the whole state within 1e-4 of each tensor's norm), resume from an eager
checkpoint and the reverse, export without compile wrappers in the keys, compile each graph once (0
recompiles after step 2, logged), and a tower that cannot compile stops the run with the reason. On 2 ranks:
tests/launched/test_compiled_two_ranks.py."""

import json

import open_clip
import pytest
import torch
from engine_state import full_state
from stand_ins import MASKED, SixBatches, step_log, toy_config, toy_trainer

from eva_fastclip.config import load_config
from eva_fastclip.engine.compiled import CompileFailed
from eva_fastclip.export import export_open_clip
from eva_fastclip.plan import preflight

RTOL = 1e-4


def trainer(out, *sets, steps=3, resume=None):
    cfg = toy_config(out, *MASKED, f"train.steps={steps}", "train.save_every_steps=2", *sets, base=())
    return toy_trainer(cfg, loader=SixBatches(), resume=resume)


def trained(out, *sets, **kwargs) -> dict:
    run = trainer(out, *sets, **kwargs)
    run.train()
    state = full_state(run.engine)
    run.engine.destroy()
    return state


def assert_same_state(actual: dict, expected: dict, label: str) -> None:
    assert actual.keys() == expected.keys()
    for name, tensors in expected.items():
        for what, a, b in zip(("weight", "exp_avg", "exp_avg_sq", "module"), actual[name], tensors):
            error = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
            assert error <= RTOL, f"{label}: {name} {what} differs by {error:.2e} of its norm"


def test_compiled_towers_take_the_eager_steps_resume_either_way_and_export(tmp_path):
    compiled = ("train.compile=true",)  # inductor: the code the user's run generates
    eager = trained(tmp_path / "eager")
    steps = trained(tmp_path / "compiled", *compiled)
    assert_same_state(steps, eager, "compiled")
    log = step_log(tmp_path / "compiled")
    assert [r["compile/recompiles"] for r in log] == [0.0, 0.0, 0.0] and log[-1]["compile/graphs"] >= 2
    # resumed from the other kind's step-2 checkpoint, each ends where the eager run ended
    for name, (source, sets) in {
        "from_eager": ("eager", compiled),
        "from_compiled": ("compiled", ()),
    }.items():
        out = tmp_path / name
        checkpoint = str(tmp_path / source / "checkpoints" / "step_00000002")
        assert_same_state(trained(out, *sets, resume=checkpoint), eager, f"resumed {name}")
    # the compiled run's checkpoint and export hold the plain keys open_clip loads
    folder = tmp_path / "compiled" / "checkpoints" / "step_00000003"
    export_open_clip(folder, tmp_path / "model.pt")  # verifies a strict open_clip load itself
    state = torch.load(tmp_path / "model.pt")
    assert not [key for key in state if "_orig_mod" in key]
    model = open_clip.create_model("test-vit-xs", pretrained=str(tmp_path / "model.pt"))
    torch.testing.assert_close(model.state_dict()["visual.conv1.weight"], state["visual.conv1.weight"])


@pytest.mark.parametrize(
    "sets",
    [
        ("train.grad_accum_steps=2", "train.contrastive_batch=global"),  # pass 1 without autograd, pass 2
        ("model.grad_checkpointing=true", "train.deepspeed_config=ds_configs/zero0_lamb.json"),
        ("loss.name=siglip",),
    ],
    ids=["cached-step", "checkpointing-zero0", "siglip"],
)
def test_compiled_graphs_capture_every_setting(tmp_path, sets):
    """aot_eager traces the graphs inductor compiles, without generating code: the settings' graphs are
    captured and run as the eager ones do, and none compiles again after step 2."""
    eager = trained(tmp_path / "eager", *sets)
    compiled = trained(tmp_path / "compiled", *sets, "train.compile=true", "train.compile_backend=aot_eager")
    assert_same_state(compiled, eager, "compiled")
    assert [r["compile/recompiles"] for r in step_log(tmp_path / "compiled")][-1] == 0.0


def test_a_tower_that_cannot_compile_stops_the_run_with_the_reason(tmp_path):
    import torch._dynamo

    @torch._dynamo.register_backend
    def refuses(gm, example_inputs):
        raise NotImplementedError("this backend cannot lower aten.gelu")

    run = trainer(tmp_path / "run", "train.compile=true", "train.compile_backend=refuses")
    with pytest.raises(
        CompileFailed, match=r"train\.compile: encode_image could not be compiled .*aten\.gelu"
    ):
        run.train()
    assert not (tmp_path / "run" / "checkpoints").exists() or not list(
        (tmp_path / "run" / "checkpoints").iterdir()
    )
    run.engine.destroy()


def test_a_machine_that_cannot_compile_is_told_before_anything_starts(monkeypatch):
    from torch._inductor import cpp_builder

    def no_compiler():
        raise RuntimeError("no C++ compiler found (g++, clang++)")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    cfg = load_config("configs/toy.json", ["train.compile=true"])
    (problem,) = preflight.check_compile(cfg)
    assert problem.key == "train.compile" and "C++ compiler" in problem.message
    assert "set train.compile=false" in problem.message
    assert preflight.check_compile(load_config("configs/toy.json", [])) == []


def test_the_compile_settings_are_read_from_json(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train": {"compile": True, "compile_backend": "aot_eager"}}))
    cfg = load_config(path, [])
    assert cfg.train.compile is True and cfg.train.compile_backend == "aot_eager"

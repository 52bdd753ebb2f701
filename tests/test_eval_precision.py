"""A checkpoint gives the same figures in the run that saved it and in ``eva-fastclip eval``, in whatever
precision it was trained, and both say which precision they evaluated in (engine/evaluate.py, Precision).

One rank in this process, 2 steps of the toy model at 32 px, evaluated at the end: bf16 is forced, so these
run on a CPU without native bf16 too (emulated there, slow matmuls, a small model). The 2-rank run's own
evaluation against one rank's is tests/launched/test_end_to_end.py's."""

import json

import pytest
import torch
from stand_ins import SixBatches

from eva_fastclip.cli import main
from eva_fastclip.commands.eval import load_for_evaluation
from eva_fastclip.config import load_config
from eva_fastclip.data import write_toy_dataset
from eva_fastclip.engine.build import build_trainer
from eva_fastclip.engine.evaluate import EvalPrecision, fp32_weights
from eva_fastclip.engine.setup import read_full_parameter
from eva_fastclip.plan.deepspeed_json import load_deepspeed_config

#: (DeepSpeed JSON, train.precision, eval.precision) -> the precision evaluated in, and whether the run's
#: module holds bf16 weights
CASES = {
    "deepspeed-bf16-auto": ("ds_configs/zero1_lamb.json", "bf16", "auto", "bf16"),
    "deepspeed-bf16-fp32": ("ds_configs/zero1_lamb.json", "bf16", "fp32", "fp32"),
    "autocast-bf16-auto": ("ds_configs/zero0_lamb.json", "bf16", "auto", "bf16"),
    "fp32-as-bf16": ("ds_configs/zero0_lamb.json", "fp32", "bf16", "bf16"),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_precision")
    write_toy_dataset(root, num_train=32, num_val=10, num_zeroshot=26, image_size=32, samples_per_shard=8)
    return root


@pytest.mark.parametrize("case", CASES)
def test_the_run_and_the_eval_command_give_a_checkpoint_the_same_figures(case, data, tmp_path, capsys):
    ds_config, train_precision, eval_precision, evaluated_in = CASES[case]
    sets = [
        f"eval.zeroshot_dir={data / 'zeroshot'}",
        f'eval.retrieval_shards=["{data / "val"}"]',
        "eval.workers=0",
        "eval.batch_size=8",
        f"eval.precision={eval_precision}",
        "model.name=test-vit-xs",
    ]
    cfg = load_config(
        "configs/toy.json",
        [
            *sets,
            f"train.deepspeed_config={ds_config}",
            f"train.precision={train_precision}",
            "train.batch_size=8",
            "train.steps=2",
            f"train.output_dir={tmp_path / 'run'}",
            "optim.warmup_steps=1",
            "optim.lr=1e-2",
        ],
    )
    trainer = build_trainer(cfg, load_deepspeed_config(ds_config), loader=SixBatches())
    in_run = trainer.train()
    printed = capsys.readouterr().out
    assert f"evaluated in {evaluated_in} (eval.precision=" in printed
    folder = tmp_path / "run" / "checkpoints" / "step_00000002"
    # the weights themselves, bit for bit: the run's as it evaluates them, the command's as it loads them
    module, precision = trainer.engine.module, trainer.eval_precision
    with fp32_weights(module, precision, read_full_parameter) as model:
        in_run_weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
    loaded, _ = load_for_evaluation(load_config("configs/toy.json", sets), folder)
    assert {name: t.dtype for name, t in loaded.model.state_dict().items()} == {
        name: t.dtype for name, t in in_run_weights.items()
    }
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, in_run_weights[name].reshape(tensor.shape)), name
    trainer.engine.destroy()

    output = tmp_path / "eval.json"
    args = ["eval", "--config", "configs/toy.json", *(a for s in sets for a in ("--set", s))]
    assert main([*args, "--checkpoint", str(folder), "--output", str(output)]) == 0
    said = capsys.readouterr().out
    assert f"evaluated in {evaluated_in} (eval.precision=" in said
    if eval_precision == "auto":
        assert f"(eval.precision=auto: checkpoint step_00000002 trained in {train_precision})" in said
    by_command = json.loads(output.read_text())
    by_command.pop("checkpoint")
    assert by_command == in_run


def test_a_bf16_module_is_evaluated_on_its_fp32_masters_and_given_back():
    """In a run whose module holds bf16 weights, eval.precision=fp32 evaluates the fp32 masters, and the
    module's own bf16 tensors are back afterwards (training goes on from them)."""
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    masters = {id(p): p.detach().clone() + 1e-3 for p in module.parameters()}  # not representable in bf16
    module.to(torch.bfloat16)
    held = [*module.parameters(), module[1].running_mean]
    before = [(t.data_ptr(), t.dtype, t.detach().clone()) for t in held]
    fp32 = EvalPrecision("fp32", "eval.precision=fp32")
    with fp32_weights(module, fp32, lambda p: masters[id(p)]) as model:
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert all(torch.equal(p, masters[id(p)]) for p in model.parameters())
        assert model[1].running_mean.dtype == torch.float32
    for t, (pointer, dtype, value) in zip(held, before):  # the very tensors, unchanged
        assert (t.data_ptr(), t.dtype) == (pointer, dtype) and torch.equal(t, value)
    bf16 = EvalPrecision("bf16", "eval.precision=auto")
    with fp32_weights(module, bf16, lambda p: masters[id(p)]) as model:  # its own precision: as it is
        assert [p.data_ptr() for p in model.parameters()] == [pointer for pointer, _, _ in before[:-1]]


def test_eval_precision_is_validated_and_auto_follows_the_training():
    with pytest.raises(ValueError, match=r"eval\.precision must be one of"):
        load_config(None, ["eval.precision=int8"])
    assert EvalPrecision.choose("auto", "bf16", "the model").line() == (
        "evaluated in bf16 (eval.precision=auto: the model trained in bf16)"
    )
    assert EvalPrecision.choose("auto", None, "checkpoint model.pt").name == "fp32"
    assert EvalPrecision.choose("fp32", "bf16", "the model").reason == "eval.precision=fp32"

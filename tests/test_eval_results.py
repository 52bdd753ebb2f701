"""Evaluation results across a resume, in one process: a resumed run appends to eval_results.jsonl, each
evaluated step once. (Evaluation during a 2-rank run, equal to one rank's, and clip_benchmark's evaluator on
its export: tests/launched/test_end_to_end.py.)"""

import json

from stand_ins import SixBatches

from eva_fastclip.config import load_config
from eva_fastclip.data import write_toy_dataset
from eva_fastclip.engine.build import build_trainer
from eva_fastclip.plan.deepspeed_json import load_deepspeed_config


def test_a_resumed_run_appends_to_eval_results(tmp_path):
    """3 steps, evaluated every step; resumed from step 2 to step 4: steps 1-4 once each (the step-3 line of
    the first run goes: the resumed run evaluates step 3 again); resumed when finished: step 4 once."""
    data = tmp_path / "data"  # 26 zero-shot images
    write_toy_dataset(data, num_train=32, num_val=10, num_zeroshot=26, image_size=32, samples_per_shard=8)
    sets = [f"eval.zeroshot_dir={data / 'zeroshot'}", "eval.retrieval_shards=null", "eval.every_steps=1"]
    sets += ["eval.workers=0", "eval.batch_size=8"]

    def run(steps, resume=None):
        cfg = load_config(
            "configs/toy.json",
            [
                *sets,
                "model.name=test-vit-xs",
                "train.precision=fp32",
                "train.batch_size=8",
                f"train.steps={steps}",
                "train.save_every_steps=2",
                f"train.output_dir={tmp_path / 'run'}",
                "optim.warmup_steps=1",
            ],
        )
        build_trainer(
            cfg, load_deepspeed_config(cfg.train.deepspeed_config), resume=resume, loader=SixBatches()
        ).train()
        lines = (tmp_path / "run" / "eval_results.jsonl").read_text().splitlines()
        return [json.loads(line)["step"] for line in lines]

    assert run(3) == [1, 2, 3]
    assert run(4, resume=str(tmp_path / "run" / "checkpoints" / "step_00000002")) == [1, 2, 3, 4]
    assert run(4, resume="latest") == [1, 2, 3, 4]

"""What the tests share: the environment every test and launched rank sees, toy data written once per
session, and the rank pool that starts ranks in seconds (tests/launching.py says when to use which).

Stand-in loaders, the toy config and its Trainer are in tests/stand_ins.py; launches in tests/launching.py.
"""

import os

# nothing may reach the hub; set before anything imports huggingface_hub (which reads it once), and the
# same for every launched rank and the rank pool's server
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
from launching import REPO, launcher_env  # noqa: E402


@pytest.fixture(scope="session")
def rank_pool(tmp_path_factory):
    """Ranks forked from one server that imported torch, DeepSpeed, open_clip and eva_fastclip once
    (tests/rank_pool.py): for launches where only N ranks matter, not the launcher."""
    from rank_pool import RankPool

    log = tmp_path_factory.mktemp("rank_pool") / "server.log"
    with RankPool(REPO, env=launcher_env(), log=log) as pool:
        yield pool


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory):
    """The launched runs' data: 64 training pairs of 32 px in 4 shards of 16, 8 validation and 8
    zero-shot images (eva_fastclip.data.write_toy_dataset), written once per session."""
    from eva_fastclip.data import write_toy_dataset

    root = tmp_path_factory.mktemp("toy_data")
    write_toy_dataset(root, num_train=64, num_val=8, num_zeroshot=8, image_size=32, samples_per_shard=16)
    return root

"""A training loader worker killed under its rank (SIGKILL, as the kernel's OOM killer sends it): the epoch
fails naming the worker's pid and its signal (eva_fastclip/data/train_workers.py)."""

import os
import signal
import time

import open_clip
import pytest
from torchvision import transforms

from eva_fastclip.data import TrainLoader

PREPROCESS = transforms.Compose([transforms.Resize((8, 8)), transforms.ToTensor()])


def test_a_loader_worker_that_dies_ends_the_epoch_naming_it(toy_data):
    """SIGKILL to a worker: the epoch fails naming the worker's pid and its signal, whether PyTorch's
    status check (every 5 s) saw it first or its queue's pipe broke first; the worker is the fork server's
    child, not the rank's."""
    loader = TrainLoader(
        # 32 batches a worker: a worker runs at most 2 batches ahead (prefetch), so the victim has work left
        [str(toy_data / "train")], preprocess=PREPROCESS, tokenize=open_clip.get_tokenizer("ViT-B-32"),
        batch_size=1, num_samples=64, workers=2, needs_index=False, shuffle_buffer=0,
    )  # fmt: skip
    batches = iter(loader)
    next(batches)
    (victim, *_) = loader.worker_pids
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    named = (
        rf"training loader worker\(s\) died: pid {victim} \(exit code -9\)"
        rf"|DataLoader worker \(pid\(s\) [^)]*{victim}[^)]*\) exited unexpectedly"  # PyTorch's, as it is
    )
    with pytest.raises(RuntimeError, match=named):
        for _ in batches:
            pass
    print(f"a dead loader worker was named {time.monotonic() - killed:.1f} s after its SIGKILL")

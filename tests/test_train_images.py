"""The training loader's image path with open_clip's training transform (data/image_transform.py): workers
hand uint8 crops to the trainer, which normalises them on its device (or decodes them there with
``decode_device``). Checked against the generic path (PIL and the Compose itself, float out of the workers)
on the same samples and crops, through corrupt JPEGs, an exact mid-epoch resume, and the config's refusal of
GPU decoding where there is no GPU."""

import io

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_sample_images
from torchvision import transforms

from eva_fastclip.config import ConfigError, load_config
from eva_fastclip.data import TrainLoader, write_shard
from eva_fastclip.data.image_transform import EncodedJpeg
from eva_fastclip.data.sample_keys import sample_key
from eva_fastclip.plan import preflight

SIZE = 32
MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
# open_clip's training Compose, as image_transform() builds it for a 32-px model
COMPOSE = transforms.Compose(
    [
        transforms.RandomResizedCrop(
            SIZE, scale=(0.9, 1.0), interpolation=transforms.InterpolationMode.BICUBIC
        ),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ]
)


def generic(image):  # the same transform, but not a Compose the fast path recognises: PIL, float out
    return COMPOSE(image)


def jpeg(photo: np.ndarray, rng: np.random.Generator) -> bytes:
    """A distinct crop of a photograph, 40-90 px, as JPEG."""
    h, w = rng.integers(40, 91, size=2)
    top, left = rng.integers(0, photo.shape[0] - h), rng.integers(0, photo.shape[1] - w)
    buffer = io.BytesIO()
    Image.fromarray(photo[top : top + h, left : left + w]).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """2 shards of 24 JPEG samples; sample 5 is cut short and sample 30 is not an image."""
    folder = tmp_path_factory.mktemp("jpeg_shards")
    photos, rng = load_sample_images().images, np.random.default_rng(0)
    samples = [
        {"__key__": f"{i:04d}", "jpg": jpeg(photos[i % 2], rng), "txt": f"photo {i}", "json": {"key": i}}
        for i in range(48)
    ]
    samples[5]["jpg"] = samples[5]["jpg"][: len(samples[5]["jpg"]) // 2]
    samples[30]["jpg"] = b"\xff\xd8\xff\xe0 not a jpeg at all"
    write_shard(folder / "a.tar", samples[:24])
    write_shard(folder / "b.tar", samples[24:])
    return [str(folder / "a.tar"), str(folder / "b.tar")]


@pytest.fixture(scope="module")
def tokenize():
    return open_clip.get_tokenizer("ViT-B-32")


def make(shards, tokenize, preprocess=COMPOSE, **kwargs):
    settings = dict(batch_size=4, num_samples=44, index_size=48, seed=3, shuffle_buffer=5, workers=1)
    return TrainLoader(shards, preprocess=preprocess, tokenize=tokenize, **{**settings, **kwargs})


def epoch(loader, epoch=0):
    loader.set_epoch(epoch)
    return list(loader)


def to_uint8(normalised: torch.Tensor) -> torch.Tensor:
    """The generic path's float images back on the 0-255 scale."""
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    return (normalised * std + mean) * 255


def test_the_fast_path_is_the_compose_on_the_same_samples_and_crops(shards, tokenize):
    fast, slow = make(shards, tokenize), make(shards, tokenize, preprocess=generic)
    assert fast.image_transform is not None and slow.image_transform is None
    fast_batches, slow_batches = epoch(fast), epoch(slow)
    assert len(fast_batches) == len(slow_batches) == 11
    differences = []
    for (images, tokens, indices, keys), (reference, ref_tokens, ref_indices, ref_keys) in zip(
        fast_batches, slow_batches
    ):
        assert images.dtype == torch.uint8 and images.shape == (
            4,
            3,
            SIZE,
            SIZE,
        )  # a quarter of float32's bytes
        assert torch.equal(indices, ref_indices) and torch.equal(tokens, ref_tokens)
        assert torch.equal(keys, ref_keys)
        # the same crop box (the same draws), resized by torch's kernel instead of PIL's: their bicubic
        # kernels round apart (measured here: 1.2% of values 1 level apart, 0.002% 2 levels, mean 0.013)
        differences.append((images.float() - to_uint8(reference)).abs().flatten())
        # normalised on the device: ToTensor's and Normalize's arithmetic on those uint8 values
        model_input = fast.to_device(images, torch.device("cpu"), torch.float32)
        assert torch.equal(model_input, COMPOSE.transforms[2](images.float() / 255))
    difference = torch.cat(differences)
    assert difference.max() <= 2.0 + 1e-3 and difference.mean() < 0.05
    # the corrupt samples were skipped on both paths, as undecodable images
    assert fast.skipped_by_reason["undecodable_image"] == slow.skipped_by_reason["undecodable_image"] == 2
    drawn = torch.cat([batch[2] for batch in fast_batches]).tolist()
    assert 5 not in drawn and 30 not in drawn and len(set(drawn)) == 44


def test_decoding_on_the_device_gives_the_workers_images(shards, tokenize):
    on_device = make(shards, tokenize, decode_device="cpu")  # the GPU path, run on the CPU here
    in_workers = make(shards, tokenize)
    for (items, _, indices, _), (images, _, ref_indices, _) in zip(epoch(on_device), epoch(in_workers)):
        assert isinstance(items, list) and torch.equal(indices, ref_indices)
        # the workers read only headers: the JPEGs travel encoded, 1-D
        assert all(isinstance(item, EncodedJpeg) and item.data.dim() == 1 for item in items)
        decoded = on_device.to_device(items, torch.device("cpu"), torch.float32)
        assert torch.equal(decoded, in_workers.to_device(images, torch.device("cpu"), torch.float32))
    assert (
        on_device.skipped_by_reason["undecodable_image"] == 2
    )  # cut short or not a JPEG: refused in the worker


def test_a_resumed_epoch_crops_as_the_uninterrupted_one(shards, tokenize):
    whole = epoch(make(shards, tokenize), epoch=1)
    first = make(shards, tokenize)
    first.set_epoch(1)
    head = []
    for batch in first:
        head.append(batch)
        if len(head) == 4:
            break
    second = make(shards, tokenize)
    assert second.resume(1, 4, first.state_dict())
    resumed = head + [batch for batch in second]
    assert len(resumed) == len(whole)
    for (images, _, indices, keys), (ref_images, _, ref_indices, ref_keys) in zip(resumed, whole):
        assert torch.equal(indices, ref_indices) and torch.equal(images, ref_images)
        assert torch.equal(keys, ref_keys)


def test_a_samples_key_and_crop_do_not_depend_on_the_layout(shards, tokenize):
    """1 rank with 1 worker and 2 ranks with 2 workers each, batches of 4 and 2: every sample drawn by
    both has the same key, the seed's, the epoch's and its index's alone
    (data/sample_keys.py), and the same crop. Another epoch crops it anew."""

    def by_index(loaders, number=1):
        out = {}
        for loader in loaders:
            for images, _, indices, keys in epoch(loader, number):
                out.update({int(i): (int(k), image) for i, k, image in zip(indices, keys, images)})
        return out

    one = by_index([make(shards, tokenize)])
    two = by_index([make(shards, tokenize, batch_size=2, rank=r, world_size=2, workers=2) for r in (0, 1)])
    both = sorted(one.keys() & two.keys())
    assert len(both) >= 20  # (no record counts the shards: whole shards go to consumers, an epoch's part)
    for index in both:
        assert one[index][0] == two[index][0] == sample_key(3, 1, index), index
        assert torch.equal(one[index][1], two[index][1]), index
    other_epoch = by_index([make(shards, tokenize)], number=2)
    assert sum(not torch.equal(other_epoch[i][1], one[i][1]) for i in both if i in other_epoch) > 10


def test_gpu_decoding_is_refused_without_a_gpu_and_unknown_values_always():
    cfg = load_config("configs/toy.json", ["data.image_decode=gpu"])
    problems = preflight.check_image_decode(cfg)
    if torch.cuda.is_available():
        assert problems == []
    else:
        assert [p.key for p in problems] == ["data.image_decode"]
        assert "data.image_decode=workers" in problems[0].message
    with pytest.raises(ConfigError, match="data.image_decode must be one of"):
        load_config("configs/toy.json", ["data.image_decode=nvjpeg"])


def test_gpu_decoding_needs_open_clips_transform(shards, tokenize):
    with pytest.raises(ValueError, match="data.image_decode=gpu needs open_clip's training transform"):
        make(shards, tokenize, preprocess=generic, decode_device="cpu")

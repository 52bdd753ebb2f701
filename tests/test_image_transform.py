"""The split training transform against open_clip's own Compose: same crop boxes, same pixels within the
stated tolerances, same refusals, and a model that sees no difference from the reduced-size decode."""

import dataclasses
import io

import numpy as np
import open_clip
import PIL.Image
import pytest
import torch
import torchvision.transforms as T
from sklearn.datasets import load_sample_images

import eva_fastclip.models.factory  # noqa: F401  (registers the tiny test architectures)
from eva_fastclip.data.image_transform import (
    TrainImageTransform,
    decode_on_device,
    explain_unrecognised,
    normalize,
)
from eva_fastclip.data.tar_reader import decode_image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def train_compose(size=224, interpolation=T.InterpolationMode.BICUBIC) -> T.Compose:
    """open_clip's training transform, as create_model_and_transforms builds it."""
    _, compose, _ = open_clip.create_model_and_transforms("test-vit-xs", force_image_size=size)
    compose.transforms[0].interpolation = interpolation
    return compose


@pytest.fixture(scope="module")
def photos() -> list[np.ndarray]:
    return load_sample_images().images  # two real photographs, 640 x 427


def encode(array: np.ndarray, size: tuple[int, int], fmt="JPEG", mode="RGB", **options) -> bytes:
    image = PIL.Image.fromarray(array).resize(size, PIL.Image.BICUBIC).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def compose_crop(compose: T.Compose, data: bytes, seed: int) -> torch.Tensor:
    """Today's path up to the crop: PIL decode, RandomResizedCrop under torch.manual_seed, as uint8."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cropped = compose.transforms[0](decode_image(data))
    return torch.from_numpy(np.array(cropped)).permute(2, 0, 1)


def ours(transform: TrainImageTransform, data: bytes, seed: int) -> torch.Tensor:
    return transform(data, torch.Generator().manual_seed(seed))


def test_recognises_open_clip_training_compose_only():
    for size in (32, 224):  # a tiny test model's, and ViT-B-16's (as create_model_and_transforms builds it)
        train, evaluation = (open_clip.image_transform(size, is_train=is_train) for is_train in (True, False))
        transform = TrainImageTransform.from_preprocess(train)
        crop = train.transforms[0]
        assert transform is not None, explain_unrecognised(train)
        assert (transform.size, transform.scale) == (tuple(crop.size), tuple(crop.scale))
        assert transform.mean == CLIP_MEAN and transform.std == CLIP_STD
        assert TrainImageTransform.from_preprocess(evaluation) is None
        assert "RandomResizedCrop" in explain_unrecognised(evaluation)
    jitter_cfg = {"color_jitter_prob": 0.5, "color_jitter": (0.1,) * 4}
    with pytest.warns(UserWarning, match="Unused augmentation"):  # open_clip applies it only with timm
        jitter = open_clip.image_transform(32, is_train=True, aug_cfg=jitter_cfg)
    assert TrainImageTransform.from_preprocess(jitter) is None
    assert "color_jitter" in explain_unrecognised(jitter)
    assert "not a torchvision Compose" in explain_unrecognised(lambda image: image)


def test_crop_box_draws_as_torchvision_get_params():
    transform = TrainImageTransform.from_preprocess(train_compose())
    # near-square sizes draw a random box; very wide / tall / tiny ones fall back to the central crop
    for width, height in [(256, 256), (300, 280), (480, 640), (1000, 997), (2000, 300), (50, 900), (3, 2)]:
        for seed in range(40):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                expected = T.RandomResizedCrop.get_params(
                    torch.empty(3, height, width), list(transform.scale), list(transform.ratio)
                )
            assert transform.crop_box(width, height, torch.Generator().manual_seed(seed)) == expected


@pytest.mark.parametrize("interpolation", [T.InterpolationMode.BICUBIC, T.InterpolationMode.BILINEAR])
def test_full_size_path_matches_open_clip_compose(photos, interpolation):
    """Every format and mode against the Compose on the same box: within 1 level of 255 per pixel (PIL's and
    torch's resize round differently), and the normalised floats within 1 level too."""
    compose = train_compose(64, interpolation)
    transform = TrainImageTransform.from_preprocess(compose)
    assert transform.interpolation == interpolation
    samples = [
        encode(photos[0], (256, 250), quality=95),
        encode(photos[1], (120, 118), quality=90, progressive=True),
        encode(photos[1], (110, 100), mode="L", quality=90),
        encode(photos[0], (110, 100), mode="CMYK", quality=90),
        encode(photos[0], (100, 110), fmt="PNG"),
        encode(photos[1], (100, 110), fmt="PNG", mode="RGBA"),
        encode(photos[1], (100, 110), fmt="GIF", mode="P"),
        encode(photos[0], (100, 110), fmt="WEBP", quality=90),
    ]
    full = dataclasses.replace(transform, reduced_decode=False)
    for data in samples:
        for seed in range(3):
            expected = compose_crop(compose, data, seed)
            got = ours(full, data, seed)
            assert got.dtype == torch.uint8 and got.shape == (3, 64, 64)
            assert (got.int() - expected.int()).abs().max() <= 1
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                reference = compose(decode_image(data))
            normalised = normalize(got[None], transform.mean, transform.std, torch.float32)[0]
            assert torch.allclose(normalised, reference, atol=1.01 / 255 / min(CLIP_STD), rtol=0)


@pytest.mark.parametrize("interpolation", [T.InterpolationMode.BICUBIC, T.InterpolationMode.BILINEAR])
def test_upsampled_and_mixed_crops_stay_within_the_stated_bound(photos, interpolation):
    """Crops that grow (100 x 90 to 224) or shrink on one axis and grow on the other (220-300 px images):
    bicubic within 6 levels on at most 0.1% of the pixels (2 where both axes grow), bilinear within 1."""
    compose = train_compose(224, interpolation)
    transform = TrainImageTransform.from_preprocess(compose)
    bicubic = interpolation == T.InterpolationMode.BICUBIC
    for size, bound in (((100, 90), 2), ((220, 230), 6), ((240, 240), 6), ((300, 200), 6)):
        for photo in photos:
            data = encode(photo, size, fmt="PNG")
            for seed in range(4):
                error = (ours(transform, data, seed).int() - compose_crop(compose, data, seed).int()).abs()
                assert error.max() <= (bound if bicubic else 1), (size, seed)
                assert (error > 1).float().mean() <= 0.001, (size, seed)


def test_a_crop_of_the_output_size_is_its_own_tensor(photos):
    """A box of exactly the output size is not resized: the result must not be a view of the whole decoded
    image, which would all go through shared memory with it."""
    transform = TrainImageTransform.from_preprocess(train_compose(64))
    image = torch.tensor(photos[0][:100, :100]).permute(2, 0, 1).contiguous()
    cropped = transform.resize(image, (10, 20, 64, 64))
    assert cropped.is_contiguous() and cropped.untyped_storage().nbytes() == 3 * 64 * 64
    assert torch.equal(cropped, image[:, 10:74, 20:84])


def test_normalize_is_bit_identical_to_to_tensor_and_normalize():
    compose = train_compose(32)
    images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    tail = T.Compose(compose.transforms[2:])  # ToTensor, Normalize
    expected = torch.stack([tail(PIL.Image.fromarray(image.permute(1, 2, 0).numpy())) for image in images])
    got = normalize(images, CLIP_MEAN, CLIP_STD, torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert torch.equal(normalize(images, CLIP_MEAN, CLIP_STD, torch.bfloat16), expected.to(torch.bfloat16))


def test_refuses_what_pil_refuses(photos):
    transform = TrainImageTransform.from_preprocess(train_compose(32))
    jpeg = encode(photos[0], (300, 280), quality=95)
    broken = [jpeg[: int(len(jpeg) * cut)] for cut in (0.3, 0.7, 0.99)] + [jpeg[:-2], b"garbage", b""]
    broken.append(encode(photos[0], (100, 110), fmt="PNG")[:500])
    for data in broken:
        with pytest.raises(Exception):  # noqa: B017  (the reference: PIL refuses it)
            decode_image(data)
        for call in (transform, transform.device_plan):
            with pytest.raises(Exception):  # noqa: B017  (the loader skips any exception as undecodable)
                call(data, torch.Generator().manual_seed(0))
    for data in (jpeg[: len(jpeg) // 2], jpeg[:-1]):  # cut short: refused on the reduced path too
        with pytest.raises(OSError):
            small = TrainImageTransform((8, 8), transform.scale, transform.ratio, CLIP_MEAN, CLIP_STD)
            small(data, torch.Generator().manual_seed(0))
    # bytes after the end marker: PIL accepts them, so do we
    assert transform(jpeg + b"trailing", torch.Generator().manual_seed(0)).shape == (3, 32, 32)


def test_keeps_pils_decompression_bomb_limit(photos, monkeypatch):
    transform = TrainImageTransform.from_preprocess(train_compose(32))
    data = encode(photos[0], (300, 280), quality=90)
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 300 * 280 // 2 - 1)
    for call in (transform, transform.device_plan):
        with pytest.raises(PIL.Image.DecompressionBombError):
            call(data, torch.Generator().manual_seed(0))
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 300 * 280 - 1)
    with pytest.warns(PIL.Image.DecompressionBombWarning):
        transform(data, torch.Generator().manual_seed(0))


def test_reduction_is_the_largest_that_keeps_the_crop_at_least_the_output():
    transform = TrainImageTransform((100, 50), (0.9, 1.0), (0.75, 4 / 3), CLIP_MEAN, CLIP_STD)
    assert transform._reduction((0, 0, 199, 999)) == 1
    assert transform._reduction((0, 0, 200, 100)) == 1  # 1/2 is not used: slower than full (module doc)
    assert transform._reduction((0, 0, 399, 400)) == 1
    assert transform._reduction((0, 0, 400, 399)) == 4
    assert transform._reduction((0, 0, 1000, 400)) == 8
    assert transform._reduction((0, 0, 5000, 5000)) == 8


@pytest.fixture(scope="module")
def large_jpegs(photos) -> list[bytes]:
    """The photographs at 900-1400 px, JPEG q95, near-square so that the crop boxes vary with the seed."""
    sizes = [(900, 880), (1003, 937), (1190, 1230), (1400, 1350)]
    return [encode(photo, size, quality=95) for photo in photos for size in sizes]


def test_reduced_decode_matches_full_decode(large_jpegs):
    """Reduced-size decode (1/4 with a 224-px output; smaller photos decode full size) vs the full-size path.

    Measured on these photographs: mean 0.3-2.8 levels of 255, 99th percentile 3-18: libjpeg's DCT scaling
    is a sharper filter than a bicubic antialias. The model check below says what that is worth."""
    transform = TrainImageTransform.from_preprocess(train_compose(224))
    full = dataclasses.replace(transform, reduced_decode=False)
    reductions = set()
    for data in large_jpegs:
        for seed in range(2):
            width, height = PIL.Image.open(io.BytesIO(data)).size
            reductions.add(
                transform._reduction(transform.crop_box(width, height, torch.Generator().manual_seed(seed)))
            )
            difference = (ours(transform, data, seed).float() - ours(full, data, seed).float()).abs()
            assert difference.mean() < 3.0
            assert difference.flatten().quantile(0.99) < 20
    assert reductions == {1, 4}  # 1: the full-size path, compared with itself


def test_reduced_decode_changes_embeddings_less_than_a_one_percent_crop_shift(large_jpegs):
    """A model's view: a tiny open_clip ViT at 224 px embeds each image decoded both ways. The reduced
    decode must move the embedding less than shifting the crop box by 1% of the image does (an
    augmentation change far below RandomResizedCrop's own spread), and each reduced-path embedding's
    nearest neighbour among all full-path ones (8 photos) must be its own."""
    torch.manual_seed(0)
    model = open_clip.create_model("test-vit-xs", force_image_size=224).eval()
    transform = TrainImageTransform.from_preprocess(train_compose(224))
    full = dataclasses.replace(transform, reduced_decode=False)
    reduced, exact, shifted = [], [], []
    for data in large_jpegs:
        with PIL.Image.open(io.BytesIO(data)) as header:
            width, height = header.size
        for seed in range(1):
            box = transform.crop_box(width, height, torch.Generator().manual_seed(seed))
            reduced.append(ours(transform, data, seed))
            exact.append(ours(full, data, seed))
            top, left, h, w = box
            step = max(1, width // 100)
            moved = (top, left + step if left + step + w <= width else left - step, h, w)
            with PIL.Image.open(io.BytesIO(data)) as image:
                decoded = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
            shifted.append(full.resize(decoded, moved))
    with torch.no_grad():
        embed = [
            torch.nn.functional.normalize(
                model.encode_image(normalize(torch.stack(images), CLIP_MEAN, CLIP_STD, torch.float32)), dim=-1
            )
            for images in (reduced, exact, shifted)
        ]
    by_path = (embed[0] * embed[1]).sum(-1)
    by_shift = (embed[2] * embed[1]).sum(-1)
    assert ((1 - by_path) < (1 - by_shift)).all(), (by_path, by_shift)
    assert torch.equal((embed[0] @ embed[1].T).argmax(1), torch.arange(len(reduced)))


def test_decode_on_device_matches_the_worker_path(photos, large_jpegs):
    """device_plan + decode_on_device (here on the CPU) against __call__ with the same seeds: identical
    where __call__ decodes full size, within the reduced-decode tolerance where it decodes reduced."""
    transform = TrainImageTransform.from_preprocess(train_compose(224))
    samples = [
        encode(photos[0], (300, 290), quality=95),
        encode(photos[1], (256, 260), fmt="PNG"),
        encode(photos[1], (280, 270), mode="CMYK", quality=90),
        encode(photos[0], (270, 300), mode="L", quality=90),
        large_jpegs[0],
    ]
    items = [
        transform.device_plan(data, torch.Generator().manual_seed(seed)) for seed, data in enumerate(samples)
    ]
    assert [isinstance(item, tuple) for item in items] == [True, False, False, True, True]
    batch = decode_on_device(items, transform, torch.device("cpu"))
    assert batch.dtype == torch.uint8 and batch.shape == (len(samples), 3, 224, 224)
    worker = torch.stack([ours(transform, data, seed) for seed, data in enumerate(samples)])
    assert torch.equal(batch[:4], worker[:4])
    assert (batch[4].float() - worker[4].float()).abs().mean() < 3.0


def test_a_batch_the_device_decoder_refuses_is_decoded_one_by_one(photos, monkeypatch):
    """One file the device's decoder refuses fails its batched call: each JPEG is then decoded alone, the
    refused one by PIL, and the batch equals the worker path's; a JPEG neither decodes names both errors."""
    from eva_fastclip.data import image_transform

    transform = TrainImageTransform.from_preprocess(train_compose(64))
    samples = [encode(photos[0], (90, 80), quality=95), encode(photos[1], (80, 90), quality=95)]
    items = [
        transform.device_plan(data, torch.Generator().manual_seed(seed)) for seed, data in enumerate(samples)
    ]
    refused = items[1].data
    real_decode = image_transform.decode_jpeg

    def device_decoder(data, **options):
        if isinstance(data, list) or data is refused:
            raise RuntimeError("nvjpeg: unsupported JPEG (simulated)")
        return real_decode(data, **options)

    monkeypatch.setattr(image_transform, "decode_jpeg", device_decoder)
    batch = decode_on_device(items, transform, torch.device("cpu"))
    worker = torch.stack([ours(transform, data, seed) for seed, data in enumerate(samples)])
    assert torch.equal(batch, worker)

    damaged = image_transform.EncodedJpeg(refused[: len(refused) // 2].clone(), items[1].box)
    refused = damaged.data
    with pytest.raises(RuntimeError, match="decodes neither on cpu .* nor with PIL"):
        decode_on_device([items[0], damaged], transform, torch.device("cpu"))

"""Training images decoded and augmented on the training device (``--decode-on device``).

The CPU pipeline (``transforms.build_transforms``) has the DataLoader workers decode every image and augment it;
on a GPU that outruns them (an EfficientNet-Lite0 step takes ~19 ms for 128 images), the workers become the
bottleneck. Here the work is split:

- the workers (``EncodedImages``) read each file's bytes and its header only: the image's size, and whether the GPU
  decoder would see the same pixels as ``decode.read_image`` (a baseline RGB JPEG without colour profile or EXIF
  rotation, small enough that ``read_image`` would not reduce it). They draw the sample's random crop and flip from
  its own seed, exactly as the CPU pipeline draws them (the same torchvision functions on the same random stream),
  and hand over the JPEG bytes and the crop box. Every other image (PNG, a CMYK or rotated JPEG, an array of a
  built-in data set) is decoded by ``read_image`` in the worker as before and handed over as pixels;
- the main process (``DeviceAugment``) decodes the batch's JPEGs with ``torchvision.io.decode_jpeg`` on the device
  (nvJPEG on CUDA), in groups of bounded pixel count, then crops, resizes (antialiased bilinear), flips, applies any
  colour augmentation and normalises there.

Geometry is the CPU pipeline's: the box is drawn on the image resized to ``RESIZE_RATIO`` x the input size and
mapped back to the decoded image, so the crop is resized once instead of twice (pixel values differ by that
resampling and by the JPEG decoder, not by what the crop shows). A model that letterboxes (``resize`` pad) gets the
``transforms.Letterbox`` draw instead (``draw_placement``): the whole image resized to the drawn size and put at the
drawn place on a canvas of the model's background.
"""

from __future__ import annotations

import io
import math
import os
import queue
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from torch.nn import functional as F
from torch.utils.data import Dataset, Subset
from torchvision import transforms as v1
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from retrieval.data.augment import Augmentation
from retrieval.data.colour import has_alpha
from retrieval.data.dataset import BadSample, LoadedBatch, array_to_image, sample_seeded, sample_source
from retrieval.data.decode import DEFAULT_MAX_PIXELS, open_regular_file, read_image
from retrieval.data.decode_memory import MAX_ASPECT, MIN_SHORT_SIDE
from retrieval.data.eval_preprocess import CROP, letterboxed_size
from retrieval.data.exif_icc import orientation
from retrieval.data.preprocessing import RESIZE_RATIO, ModelPreprocessing, resized_size
from retrieval.data.transforms import PAD_SCALE, ScaleAndNormalise, background_of, colour_steps
from retrieval.utils.reads import to_device

# pixels decoded on the device at once: bounds the decoder's output memory (3 bytes a pixel) whatever the batch holds
GROUP_PIXELS = 64_000_000
# a JPEG file larger than this many bytes per pixel (plus slack) holds more than its image: the CPU path reads it
MAX_JPEG_BYTES_PER_PIXEL = 4
_JPEG_SLACK = 1 << 20


@dataclass(frozen=True)
class EncodedImage:
    """One training image as a worker hands it over: JPEG bytes to decode on the device, or decoded pixels."""

    data: torch.Tensor  # uint8: [N] the JPEG file's bytes (``encoded``), or [3, H, W] RGB pixels
    encoded: bool
    shape: tuple[int, int]  # height, width of the decoded image
    # top, left, height, width: of the crop in the decoded image; for a letterboxing model, of the whole image
    # resized, on the square canvas
    box: tuple[int, int, int, int]
    flip: bool
    seed: int  # seeds the colour augmentation on the device


@dataclass(frozen=True)
class EncodedBatch:
    """A batch of ``EncodedImage``s, their labels and dataset positions (the workers' collate output).

    Sent from a DataLoader worker, the images' bytes travel as one tensor (``__reduce__``): torch shares every tensor
    through a shared-memory file of its own, and one file a batch instead of one an image made the hand-over 1.5x
    faster on a 2-core CPU (docs/BENCHMARKS.md)."""

    images: list[EncodedImage]
    labels: torch.Tensor
    indices: torch.Tensor

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if any(image.data.dtype != torch.uint8 for image in self.images):
            raise ValueError("an EncodedBatch holds uint8 data only (JPEG bytes or RGB pixels): the packed batch would "
                             "convert the others")
        packed = torch.cat([image.data.reshape(-1) for image in self.images]) if self.images else \
            torch.empty(0, dtype=torch.uint8)
        layout = [(tuple(image.data.shape), image.encoded, image.shape, image.box, image.flip, image.seed)
                  for image in self.images]
        return _unpack_batch, (packed, layout, self.labels, self.indices)


def _unpack_batch(packed: torch.Tensor, layout: list[tuple[Any, ...]], labels: torch.Tensor,
                  indices: torch.Tensor) -> EncodedBatch:
    """``EncodedBatch.__reduce__``'s inverse: each image's data a view of the one packed tensor."""
    sizes = [math.prod(data_shape) for data_shape, *_ in layout]
    if sum(sizes) != packed.numel():
        raise ValueError(f"a packed batch of {packed.numel()} bytes does not hold its images' {sum(sizes)}")
    parts = torch.split(packed, sizes)
    images = [EncodedImage(part.view(data_shape), *rest) for part, (data_shape, *rest) in zip(parts, layout,
                                                                                              strict=True)]
    return EncodedBatch(images, labels, indices)


def draw_box(height: int, width: int, size: int, augmentation: Augmentation) -> tuple[tuple[int, int, int, int], bool]:
    """The crop box (top, left, height, width) in an image of ``height`` x ``width`` and the flip, drawn from torch's
    RNG as ``build_transforms`` draws them: on the image resized to ``RESIZE_RATIO`` x ``size``, then mapped back."""
    rw, rh = resized_size(width, height, int(size * RESIZE_RATIO))  # (width, height): PIL's order
    shape = torch.zeros(()).expand(1, rh, rw)  # only its shape is read
    if augmentation.random_crop:
        top, left, h, w = v1.RandomResizedCrop.get_params(shape, list(augmentation.crop_scale),
                                                          list(augmentation.crop_ratio))
    else:
        h, w = min(size, rh), min(size, rw)
        top, left = int(round((rh - h) / 2.0)), int(round((rw - w) / 2.0))
    flip = bool(augmentation.flip and torch.rand(1) < 0.5)  # RandomHorizontalFlip: flips when rand < p
    sy, sx = height / rh, width / rw
    top_o, left_o = min(int(round(top * sy)), height - 1), min(int(round(left * sx)), width - 1)
    h_o = max(1, min(int(round((top + h) * sy)), height) - top_o)
    w_o = max(1, min(int(round((left + w) * sx)), width) - left_o)
    return (top_o, left_o, h_o, w_o), flip


def draw_placement(height: int, width: int, size: int, augmentation: Augmentation
                   ) -> tuple[tuple[int, int, int, int], bool]:
    """Where a letterboxing model's training puts an image of ``height`` x ``width`` on its ``size`` canvas (top,
    left, height, width of the image resized) and the flip, drawn from torch's RNG as ``transforms.Letterbox`` and
    the flip after it draw them: a random long side in ``PAD_SCALE`` x ``size`` and place (with a random crop), else
    the whole side, centred."""
    side = size
    if augmentation.random_crop:
        low, high = PAD_SCALE
        side = max(1, min(size, round(size * (low + (high - low) * float(torch.rand(1))))))
    w, h = letterboxed_size(width, height, side)
    if augmentation.random_crop:
        left, top = int(torch.randint(size - w + 1, ())), int(torch.randint(size - h + 1, ()))
    else:
        left, top = (size - w) // 2, (size - h) // 2
    flip = bool(augmentation.flip and torch.rand(1) < 0.5)
    return (top, left, h, w), flip


def jpeg_for_device(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int] | None:
    """(height, width) of a JPEG whose device decode gives ``read_image``'s pixels, else None (decode on the CPU).

    Reads the header only. A JPEG qualifies when it is baseline, three-channel RGB (YCbCr), without colour profile
    or EXIF rotation, within the pixel limit and small and square enough that ``read_image`` keeps it as it is."""
    if data[:3] != b"\xff\xd8\xff":
        return None
    try:
        with Image.open(io.BytesIO(data), formats=["JPEG"]) as image:
            width, height = image.size
            plain = (image.mode == "RGB" and not image.info.get("icc_profile") and not image.info.get("progressive")
                     and not image.info.get("progression") and orientation(image) == 1)
    except Exception:  # noqa: BLE001  (anything odd: the CPU decoder gives the precise error)
        return None
    pixels = width * height
    short, long = min(width, height), max(width, height)
    if (not plain or pixels > max_pixels or short // MIN_SHORT_SIDE > 1 or long > MAX_ASPECT * short
            or len(data) > MAX_JPEG_BYTES_PER_PIXEL * pixels + _JPEG_SLACK):
        return None
    return height, width


def _read_bytes(path: str | os.PathLike, limit: int) -> bytes | None:
    """The file's bytes, or None when it is larger than ``limit`` (a regular file only)."""
    with open_regular_file(path) as handle:
        if os.fstat(handle.fileno()).st_size > limit:
            return None
        return handle.read(limit + 1)


class EncodedImages(Dataset):
    """An ``ImageDataset`` (or a ``Subset`` of one) as ``(EncodedImage, label)`` items for ``DeviceAugment``.

    Under ``CatchBadSamples`` each item's random draws come from its own seed, so the crops match the CPU pipeline's."""

    same_indices = True  # item i is ``dataset``'s item i (``sample_source`` names its file)

    def __init__(self, dataset: Dataset, preprocessing: ModelPreprocessing, augmentation: Augmentation,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        self.dataset = dataset
        self.size = preprocessing.input_size
        self.background = background_of(preprocessing)
        self.augmentation = augmentation
        self.max_pixels = max_pixels
        self.draw = draw_box if preprocessing.resize_mode == CROP else draw_placement

    def __len__(self) -> int:
        return len(self.dataset)

    def _base(self, index: int) -> tuple[Any, int]:
        dataset = self.dataset
        while isinstance(dataset, Subset):
            index, dataset = int(dataset.indices[index]), dataset.dataset
        if not hasattr(dataset, "samples") or not hasattr(dataset, "labels"):
            raise TypeError(f"decoding on the device needs an ImageDataset (samples and labels), got {dataset!r}")
        return dataset, index

    def __getitem__(self, index: int) -> tuple[EncodedImage, int]:
        dataset, position = self._base(index)
        sample, label = dataset.samples[position], int(dataset.labels[position])
        data = None
        if isinstance(sample, (str, os.PathLike)):
            data = _read_bytes(sample, MAX_JPEG_BYTES_PER_PIXEL * self.max_pixels + _JPEG_SLACK)
        shape = jpeg_for_device(data, self.max_pixels) if data is not None else None
        if shape is not None:
            box, flip = self.draw(*shape, self.size, self.augmentation)
            pixels = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            return EncodedImage(pixels, True, shape, box, flip, _draw_seed()), label
        image = array_to_image(sample) if not isinstance(sample, (str, os.PathLike)) else \
            read_image(io.BytesIO(data) if data is not None else sample, self.max_pixels).image
        if has_alpha(image):
            image = self.background(image)
        pixels = v2.functional.pil_to_tensor(image.convert("RGB"))
        box, flip = self.draw(pixels.shape[1], pixels.shape[2], self.size, self.augmentation)
        return EncodedImage(pixels, False, tuple(pixels.shape[1:]), box, flip, _draw_seed()), label


def _decode_jpeg(data: torch.Tensor | list[torch.Tensor], device: torch.device) -> torch.Tensor | list[torch.Tensor]:
    # torchvision 0.29 deprecates its decoders for TorchCodec, which is not a dependency: keep the log clean
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*decoding and encoding.*")
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


def _draw_seed() -> int:
    return int(torch.randint(0, 2**62, (1,)))


def collate_encoded(items: Sequence[tuple[int, tuple[EncodedImage, int]] | BadSample]) -> LoadedBatch:
    """``CatchBadSamples``' items -> a ``LoadedBatch`` whose ``inputs`` is an ``EncodedBatch`` (None when none
    loaded); the bad samples go to ``.bad`` as in ``collate_dropping_bad``."""
    bad = [item for item in items if isinstance(item, BadSample)]
    good = [item for item in items if not isinstance(item, BadSample)]
    if not good:
        return LoadedBatch(None, None, torch.empty(0, dtype=torch.int64), bad)
    indices = torch.tensor([index for index, _ in good], dtype=torch.int64)
    labels = torch.tensor([label for _, (_, label) in good], dtype=torch.int64)
    batch = EncodedBatch([image for _, (image, _) in good], labels, indices)
    return LoadedBatch(batch, labels, indices, bad)


class DeviceAugment:
    """Decode (JPEG on the device), crop (or letterbox), resize, flip, colour-augment and normalise a batch on
    ``device``."""

    def __init__(self, preprocessing: ModelPreprocessing, augmentation: Augmentation, device: torch.device | str,
                 dataset: Dataset | None = None, group_pixels: int = GROUP_PIXELS) -> None:
        self.letterbox = preprocessing.resize_mode != CROP  # the boxes are placements (draw_placement)
        # the canvas colour [1, 3, 1, 1], as the CPU pipeline's Letterbox fills it
        self.canvas = torch.tensor(preprocessing.background, dtype=torch.float32).view(1, 3, 1, 1)
        self.device = torch.device(device)
        self.dataset = dataset  # names the files that fail to decode
        self.size = preprocessing.input_size
        self.normalise = ScaleAndNormalise(preprocessing, self.device)
        self.group_pixels = group_pixels
        colour = colour_steps(preprocessing, augmentation)
        self.colour = v2.Compose(colour) if colour else None

    def decode(self, images: Sequence[EncodedImage]) -> list[torch.Tensor | str]:
        """Each image's [3, H, W] uint8 pixels on the device, or the reason its JPEG could not be decoded."""
        out: list[torch.Tensor | str] = [None] * len(images)  # type: ignore[list-item]
        group: list[int] = []
        pixels = 0

        def flush() -> None:
            if group:
                for i, decoded in zip(group, self._decode_group([images[i].data for i in group]), strict=True):
                    out[i] = decoded
                group.clear()

        for i, image in enumerate(images):
            if not image.encoded:
                out[i] = image.data.to(self.device, non_blocking=True)
                continue
            size = image.shape[0] * image.shape[1]
            if group and pixels + size > self.group_pixels:
                flush()
                pixels = 0
            group.append(i)
            pixels += size
        flush()
        return out

    def _decode_group(self, data: list[torch.Tensor]) -> list[torch.Tensor | str]:
        try:
            return list(_decode_jpeg(data, self.device))
        except RuntimeError:  # one damaged file fails the whole call: decode one by one to find it
            results: list[torch.Tensor | str] = []
            for one in data:
                try:
                    results.append(_decode_jpeg(one, self.device))
                except RuntimeError as exc:
                    results.append(f"unreadable: the JPEG could not be decoded on {self.device} ({exc}); the file "
                                   "is damaged")
            return results

    def __call__(self, batch: EncodedBatch) -> tuple[torch.Tensor, torch.Tensor, list[BadSample]]:
        """(normalised float32 images [B', 3, S, S] on the device, their labels, the samples that failed)."""
        decoded = self.decode(batch.images)
        keep = [i for i, pixels in enumerate(decoded) if isinstance(pixels, torch.Tensor)]
        bad = [BadSample(int(index), self._source(int(index)), reason) for index, reason
               in zip(batch.indices.tolist(), decoded, strict=True) if isinstance(reason, str)]
        size = self.size
        resized = []
        for i in keep:
            pixels, image = decoded[i], batch.images[i]
            top, left, height, width = image.box
            if self.letterbox:
                resized.append(self._letterboxed(pixels, image.box))
                continue
            crop = pixels[:, top:top + height, left:left + width].unsqueeze(0).float()
            resized.append(F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False))
        # one concatenation rather than a copy into the batch per image: a third fewer launches on a GPU
        out = torch.cat(resized) if resized else torch.empty(0, 3, size, size, device=self.device)
        flips = torch.tensor([batch.images[i].flip for i in keep], dtype=torch.bool)
        if flips.any():
            rows = to_device(flips.nonzero().flatten(), self.device)  # queued: a plain copy waits for the stream
            out[rows] = out[rows].flip(-1)
        if self.colour is not None:
            out = self._colour(out, [batch.images[i].seed for i in keep])
        return self.normalise(out), batch.labels[keep], bad

    def _letterboxed(self, pixels: torch.Tensor, placement: tuple[int, int, int, int]) -> torch.Tensor:
        """The whole image resized to the placement's size on a canvas of the model's background [1, 3, S, S]."""
        top, left, height, width = placement
        canvas = self.canvas.to(self.device).expand(1, 3, self.size, self.size).clone()
        image = pixels.unsqueeze(0).float()
        if tuple(image.shape[-2:]) != (height, width):
            image = F.interpolate(image, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
        canvas[:, :, top:top + height, left:left + width] = image
        return canvas

    def _source(self, index: int) -> str:
        return sample_source(self.dataset, index) if self.dataset is not None else f"sample #{index}"

    def _colour(self, images: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        """Colour augmentation per image on uint8 pixels (as the CPU pipeline applies it), each from its own seed."""
        pixels = images.round_().clamp_(0, 255).to(torch.uint8)
        for row, seed in enumerate(seeds):
            with sample_seeded(seed):  # the colour steps draw from the CPU generator; the device's stay the step's
                pixels[row] = self.colour(pixels[row])
        return pixels.float()


def decoded_batches(loader: Iterable[LoadedBatch], stage: DeviceAugment, ahead: int = 2
                    ) -> Iterator[tuple[LoadedBatch, tuple[torch.Tensor, torch.Tensor, list[BadSample]] | None]]:
    """Each of ``loader``'s batches with ``stage``'s result (None when no image of it loaded), the stage running up to
    ``ahead`` batches in advance in a thread, on its own CUDA stream on a GPU: decoding overlaps the training step
    (nvJPEG's host part and the launches release the GIL while the step's kernels run)."""
    results: queue.Queue = queue.Queue(maxsize=ahead)
    stop = threading.Event()
    stream = torch.cuda.Stream(stage.device) if stage.device.type == "cuda" else None

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                results.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for batch in loader:
                if batch.inputs is None:
                    done = None
                elif stream is None:
                    done = (stage(batch.inputs), None)
                else:
                    with torch.cuda.stream(stream):
                        out = stage(batch.inputs)
                        event = torch.cuda.Event()
                        event.record(stream)
                    done = (out, event)
                if not put((batch, done)):
                    return
            put(_END)
        except BaseException as exc:  # noqa: BLE001  (handed to the consumer, which raises it)
            put(exc)

    thread = threading.Thread(target=work, name="device-decode", daemon=True)
    thread.start()
    try:
        while True:
            item = results.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            batch, done = item
            if done is None:
                yield batch, None
                continue
            (images, labels, bad), event = done
            if event is not None:  # the step's stream waits for the decode; the tensors live until it is done
                current = torch.cuda.current_stream(stage.device)
                current.wait_event(event)
                images.record_stream(current)
            yield batch, (images, labels, bad)
    finally:
        stop.set()
        thread.join(timeout=10)


_END = object()

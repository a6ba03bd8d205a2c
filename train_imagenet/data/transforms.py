"""The image transforms: timm's training augmentation (RandAugment, random erasing,
random-resized crop) and its evaluation centre crop."""
from typing import Any, Callable, List, Optional, Tuple

from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform

from ..config import Config

__all__ = ["build_transform"]


def build_transform(cfg: Config, training: bool,
                    norm: Optional[Tuple[List[float], List[float]]] = None) -> Callable:
    """timm's transforms: RandAugment, random erasing, random-resized crop; eval centre crop.
    `norm` is (mean, std) (`model.input_norm`); by default ``data.mean``/``data.std``, else
    timm's ImageNet values."""
    d, a = cfg.data, cfg.aug
    mean, std = norm or (d.mean or IMAGENET_DEFAULT_MEAN, d.std or IMAGENET_DEFAULT_STD)
    common = dict(input_size=d.img_size, interpolation=d.interpolation,
                  mean=tuple(mean), std=tuple(std), crop_pct=d.crop_pct)
    if not training or a.no_aug:
        return create_transform(is_training=False, **common)
    transform = create_transform(is_training=True, scale=tuple(a.scale), hflip=a.hflip,
                                 color_jitter=a.color_jitter, auto_augment=a.auto_augment or None,
                                 re_prob=a.reprob, re_mode=a.remode, **common)
    return _zero_bit_posterize(transform)


def _posterize(img: Image.Image, bits_to_keep: int, **kwargs: Any) -> Image.Image:
    """timm's posterize, keeping 0 bits as a black image (as Pillow < 13 did)."""
    from timm.data.auto_augment import posterize
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return posterize(img, bits_to_keep, **kwargs)


def _zero_bit_posterize(transform: Callable) -> Callable:
    """Pillow >= 13 rejects ImageOps.posterize(img, 0), which timm's RandAugment asks for at
    magnitude 10 ('rand-m9-mstd0.5-inc1' reaches it). With such a Pillow, the posterize ops of
    this transform's augmentations (RandAugment, AutoAugment, AugMix) keep 0 bits as a black
    image instead; timm's own op table is left as it is."""
    from PIL import ImageOps
    from timm.data.auto_augment import posterize
    try:
        ImageOps.posterize(Image.new("RGB", (1, 1)), 0)
        return transform
    except ValueError:
        pass
    for step in getattr(transform, "transforms", [transform]):
        ops = list(getattr(step, "ops", [])) + [op for sub in getattr(step, "policy", [])
                                                 for op in sub]
        for op in ops:
            if getattr(op, "aug_fn", None) is posterize:
                op.aug_fn = _posterize
    return transform

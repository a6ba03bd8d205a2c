"""One typed config: dataclasses, filled from a YAML file and dotted ``key=value`` overrides.

    cfg = load_config("configs/quickstart.yaml", ["epochs=3", "optim.lr=1e-3",
                                                  "model_kwargs={img_size: 32, patch_size: 4}"])

Every key is declared below with its default; an unknown key (in the YAML or on the command
line) is an error that names the closest known keys. Values are parsed as YAML and checked
against the declared type. A file may build on another with ``base: OTHER.yaml``
(`config_layers`): a recipe is written once, and each model's file states only what differs.
``save_config`` writes the resolved config to the run directory.

It is one module over 400 lines because the declarations are the documentation of every key
(each field with its comment); split, a reader would look in two places for one key.
"""
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from dcvit.cli import did_you_mean
from dcvit.io import write_text

__all__ = ["Config", "ConfigError", "load_config", "save_config", "config_to_dict", "all_keys",
           "config_layers", "BASE_KEY"]

BASE_KEY = "base"   # a config file's key naming the file it builds on (`config_layers`)


class ConfigError(ValueError):
    """A bad config value or key; the message names the value and the fix."""


@dataclass
class DataConfig:
    train: str = ""                  # WebDataset shards ('DIR/train-{000000..000099}.tar', a
                                     # directory of .tar files), timm's WebDataset folder, a
                                     # Hugging Face Parquet folder, an ImageFolder directory,
                                     # a torchvision ImageNet root (docs/data.md)
    val: str = ""
    train_split: str = ""            # the split of data.train to read; '' = 'train'
    val_split: str = ""              # '' = 'validation' or 'val', whichever the folder has
    train_labels: str = ""           # labels file of a flat image folder in data.train
    val_labels: str = ""             # labels file of a flat image folder in data.val
    label_offset: int = 0            # subtracted from integer labels of a labels file (1: 1-based)
    label_names: str = ""            # names of a labels file's integers (devkit meta.mat, a list)
    kind: str = ""                   # '' (from what is on disk) or one of data.KINDS
    num_classes: int = 1000
    img_size: int = 224
    train_samples: Optional[int] = None   # samples in data.train; counted at start-up if unset
    val_samples: Optional[int] = None
    num_workers: int = 4                  # DataLoader workers per process
    shuffle_buffer: int = 5000            # WebDataset sample shuffle buffer (per worker)
    on_corrupt: str = "skip"              # 'skip' (count and go on) or 'fail'
    mean: Optional[List[float]] = None    # default: the model's pretrained cfg
    std: Optional[List[float]] = None
    interpolation: str = "bicubic"
    crop_pct: float = 0.875               # eval: resize to img_size / crop_pct, centre crop
    pin_memory: bool = True


@dataclass
class AugConfig:
    no_aug: bool = False                  # train with the eval transform (tests, debugging)
    scale: List[float] = field(default_factory=lambda: [0.08, 1.0])
    hflip: float = 0.5
    color_jitter: float = 0.3
    auto_augment: Optional[str] = "rand-m9-mstd0.5-inc1"
    reprob: float = 0.25                  # random erasing
    remode: str = "pixel"
    mixup: float = 0.8                    # mixup alpha (0 = off)
    cutmix: float = 1.0                   # cutmix alpha (0 = off)
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    mixup_mode: str = "batch"
    smoothing: float = 0.1                # label smoothing
    bv_mixup: float = 0.0                 # big_vision's mixup: one a ~ Beta(p, p) per batch,
                                          # a = max(a, 1 - a), each image mixed with its
                                          # neighbour; the value is p (0 = off)
    repeated_aug: int = 1                 # DeiT repeated augmentation (3 in the DeiT recipe)


@dataclass
class OptimConfig:
    opt: str = "adamw"                    # any timm.optim name: adamw, lamb, sgd, ...
    lr: float = 5e-4                      # learning rate at global batch `lr_batch_size`
    lr_batch_size: Optional[int] = 512    # linear scaling reference; null = use lr as given
    weight_decay: float = 0.05            # not applied to biases, norms, pos/cls tokens
    decoupled_weight_decay: Optional[float] = None   # big_vision's `wd`: decay not scaled by
                                          # lr (p -= sched(t)·wd·p); sets the optimizer's
                                          # weight_decay to wd / lr (needs weight_decay: 0)
    betas: Optional[List[float]] = None
    eps: Optional[float] = None
    momentum: float = 0.9
    clip_grad: Optional[float] = None     # gradient clipping (max norm); null = off
    clip_mode: str = "norm"


@dataclass
class SchedConfig:
    sched: str = "cosine"
    warmup_epochs: float = 5
    warmup_steps: Optional[int] = None    # warm-up in optimizer updates (needs warmup_epochs: 0)
    warmup_prefix: bool = False           # True: the decay starts after the warm-up (big_vision)
    warmup_lr: float = 1e-6
    min_lr: float = 1e-5
    cooldown_epochs: int = 0


@dataclass
class EmaConfig:
    enabled: bool = False
    decay: float = 0.99996
    warmup: bool = False


@dataclass
class ConvertConfig:
    """Fine-tuning with DCMHA: ``dcvit.convert`` after the pretrained weights are loaded."""
    enabled: bool = False
    init: str = "identity"                # 'identity' (the pretrained function exactly) or 'paper'
    layers: Optional[List[int]] = None    # attention layers to convert (their order); null = all
    options: Dict[str, Any] = field(default_factory=dict)   # DCMHA options: rank, query_wise, ...
    lr_mult: float = 1.0                  # learning-rate multiplier of the DCMHA parameters
    weight_decay: Optional[float] = None  # weight decay of the DCMHA parameters; null = optim.weight_decay


@dataclass
class Config:
    model: str = "vit_small_patch16_224"  # any timm name; dcvit_* names exist (dcvit imported)
    model_kwargs: Dict[str, Any] = field(default_factory=dict)   # extra timm.create_model kwargs
    pretrained: str = ""                  # local weights of `model` read by timm's loader before
                                          # conversion (.safetensors, .pth, big_vision .npz)
    convert: ConvertConfig = field(default_factory=ConvertConfig)
    drop_path: float = 0.1
    grad_checkpointing: bool = False
    compile: bool = False
    data: DataConfig = field(default_factory=DataConfig)
    aug: AugConfig = field(default_factory=AugConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    epochs: int = 300
    batch_size: int = 128                 # per process
    accum_steps: int = 1                  # gradient accumulation (micro-batches per update)
    amp: str = "none"                     # 'none', 'bf16' (CPU and GPU) or 'fp16' (GPU)
    device: str = "auto"                  # 'auto', 'cpu' or 'cuda'
    threads: int = 0                      # torch CPU threads per process; 0 = torch's default
    output_dir: str = "runs/default"
    seed: int = 0
    resume: str = ""                      # 'auto' (latest valid checkpoint), a path, or ''
    resume_at_epoch_boundary: bool = False   # resume although the train data, global batch or
                                          # world size changed: from the checkpoint's next epoch
                                          # boundary, the schedule recomputed for this config
    checkpoint: str = ""                  # weights to evaluate (eval_only) or to start from
    eval_only: bool = False
    eval_every: int = 1                   # epochs between evaluations (the last always runs)
    eval_epochs: List[int] = field(default_factory=list)   # also evaluate after these epochs and
                                          # write eval-eNNNN.json (e.g. [90, 300])
    save_every_steps: int = 0             # also checkpoint every N updates inside an epoch
    keep_checkpoints: int = 2
    log_every: int = 50                   # updates between loss checks and progress lines
    tensorboard: bool = False
    dist_timeout: float = 3600            # seconds a rank waits in a collective for the others
                                          # (start-up checks, evaluation, saves included) before
                                          # the run stops with an error naming what it waited for

    def validate(self) -> "Config":
        """Checks the values that have a fixed set of choices or a range."""
        _choice("amp", self.amp, ("none", "bf16", "fp16"))
        _choice("device", self.device, ("auto", "cpu", "cuda"))
        _choice("data.on_corrupt", self.data.on_corrupt, ("skip", "fail"))
        _choice("data.kind", self.data.kind, ("", "shards", "timm-wds", "parquet", "imagefolder",
                                              "torchvision", "flat"))
        _choice("convert.init", self.convert.init, ("identity", "paper"))
        if self.convert.lr_mult < 0:
            raise ConfigError(f"convert.lr_mult={self.convert.lr_mult!r} must be >= 0")
        for key in ("epochs", "batch_size", "accum_steps", "data.num_classes", "data.img_size",
                    "aug.repeated_aug", "eval_every", "keep_checkpoints", "log_every"):
            if _get(self, key) < 1:
                raise ConfigError(f"{key}={_get(self, key)!r} must be >= 1")
        for key in ("data.num_workers", "data.shuffle_buffer", "save_every_steps", "threads",
                    "sched.warmup_epochs", "sched.warmup_lr", "sched.min_lr", "sched.cooldown_epochs",
                    "optim.weight_decay", "optim.decoupled_weight_decay", "convert.weight_decay",
                    "aug.color_jitter", "aug.mixup", "aug.cutmix"):
            value = _get(self, key)
            if value is not None and not value >= 0:
                raise ConfigError(f"{key}={value!r} must be >= 0")
        for key in ("optim.lr", "optim.lr_batch_size", "optim.eps", "optim.clip_grad",
                    "dist_timeout", "data.crop_pct"):
            value = _get(self, key)
            if value is not None and not value > 0:   # 'not >' refuses NaN too
                raise ConfigError(f"{key}={value!r} must be > 0")
        for key in ("drop_path", "optim.momentum", "aug.hflip", "aug.reprob", "aug.mixup_prob",
                    "aug.mixup_switch_prob", "ema.decay", "data.crop_pct"):
            if not 0 <= _get(self, key) <= 1:
                raise ConfigError(f"{key}={_get(self, key)!r} must be in [0, 1]")
        if self.data.std is not None and not all(v > 0 for v in self.data.std):
            raise ConfigError(f"data.std={self.data.std!r}: each value must be > 0 (the pixel "
                              f"values are divided by it); e.g. data.std=[0.229, 0.224, 0.225], "
                              f"or data.std=null for the model's")
        if not -2**63 <= self.seed < 2**63:
            raise ConfigError(f"seed={self.seed!r} must be in [-2**63, 2**63 - 1] (a 64-bit "
                              f"integer, as torch.manual_seed takes)")
        if not 0 <= self.aug.smoothing < 1:
            raise ConfigError(f"aug.smoothing={self.aug.smoothing!r} must be in [0, 1)")
        for key, pair in (("aug.scale", self.aug.scale), ("optim.betas", self.optim.betas)):
            if pair is not None and (len(pair) != 2 or not all(0 <= v <= 1 for v in pair)):
                raise ConfigError(f"{key}={pair!r} must be two numbers in [0, 1]")
        if not 0 < self.aug.scale[0] <= self.aug.scale[1]:
            raise ConfigError(f"aug.scale={self.aug.scale!r} must be [min, max] with 0 < min <= max <= 1")
        if (self.aug.mixup > 0 or self.aug.cutmix > 0) and self.batch_size % 2:
            raise ConfigError(f"batch_size={self.batch_size} must be even for mixup/cutmix "
                              f"(timm.data.Mixup pairs samples); use {self.batch_size + 1} "
                              f"or set aug.mixup=0 aug.cutmix=0")
        if self.aug.bv_mixup < 0:
            raise ConfigError(f"aug.bv_mixup={self.aug.bv_mixup!r} is the Beta parameter p and must be >= 0")
        if self.aug.bv_mixup > 0 and (self.aug.mixup > 0 or self.aug.cutmix > 0):
            raise ConfigError(f"aug.bv_mixup={self.aug.bv_mixup} and timm's mixup/cutmix "
                              f"(aug.mixup={self.aug.mixup}, aug.cutmix={self.aug.cutmix}) are both on; "
                              f"set aug.mixup=0 aug.cutmix=0 or aug.bv_mixup=0")
        if self.optim.decoupled_weight_decay is not None and self.optim.weight_decay:
            raise ConfigError(f"optim.decoupled_weight_decay={self.optim.decoupled_weight_decay} replaces "
                              f"optim.weight_decay={self.optim.weight_decay}; set optim.weight_decay=0")
        if self.sched.warmup_steps is not None:
            if self.sched.warmup_steps < 0:
                raise ConfigError(f"sched.warmup_steps={self.sched.warmup_steps!r} must be >= 0")
            if self.sched.warmup_epochs:
                raise ConfigError(f"sched.warmup_steps={self.sched.warmup_steps} and "
                                  f"sched.warmup_epochs={self.sched.warmup_epochs} both set the warm-up; "
                                  f"set sched.warmup_epochs=0")
        bad = [e for e in self.eval_epochs if not 1 <= e <= self.epochs]
        if bad:
            raise ConfigError(f"eval_epochs={self.eval_epochs}: {bad} not in [1, epochs={self.epochs}]")
        if not isinstance(self.model_kwargs, dict):
            raise ConfigError(f"model_kwargs={self.model_kwargs!r} must be a mapping, "
                              f"e.g. model_kwargs='{{img_size: 32, patch_size: 4}}'")
        return self


def _choice(key: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {list(choices)}")


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def all_keys(cls: type = Config, prefix: str = "") -> List[str]:
    """Every dotted key of the config, e.g. ['model', ..., 'optim.lr', ...]."""
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            keys += all_keys(f.type, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def _unknown(key: str) -> ConfigError:
    """The error of an unknown key, with the closest known keys ('lr' finds 'optim.lr' by its
    last part when no whole key is close)."""
    keys = all_keys()
    by_last = {k.rsplit(".", 1)[-1]: k for k in keys}
    hint = did_you_mean(key, keys + [BASE_KEY]) or \
        did_you_mean(key.rsplit(".", 1)[-1], by_last, shown=by_last)
    return ConfigError(f"unknown config key {key!r}{hint}")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Checks `value` against the declared type `tp` (ints are accepted as floats)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        return _coerce(key, value, next(a for a in args if a is not type(None)))
    if tp is Any:
        return value
    if origin in (list, List):
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} must be a list, e.g. {key}='[0.08, 1.0]'")
        return [_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin in (dict, Dict):
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping, e.g. {key}='{{a: 1}}'")
        return dict(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads '1e-3' as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if tp is str and value is None:
        return ""
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{key}={value!r} must be of type {tp.__name__}")
    return value


def _apply(obj: Any, key: str, value: Any) -> None:
    """Sets the dotted `key` of the dataclass tree `obj`; a mapping value recurses."""
    parts = key.split(".")
    target = obj
    for i, part in enumerate(parts[:-1]):
        if not dataclasses.is_dataclass(target) or part not in {f.name for f in dataclasses.fields(target)}:
            raise _unknown(key)
        target = getattr(target, part)
    name = parts[-1]
    fields = {f.name: f for f in dataclasses.fields(target)} if dataclasses.is_dataclass(target) else {}
    if name not in fields:
        raise _unknown(key)
    sub = getattr(target, name)
    if dataclasses.is_dataclass(sub):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping of {key}.* keys")
        for k, v in value.items():
            _apply(obj, f"{key}.{k}", v)
        return
    hints = typing.get_type_hints(type(target))
    setattr(target, name, _coerce(key, value, hints[name]))


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is a ConfigError instead of
    the last one silently winning (keys brought in by a ``<<`` merge may be overridden)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> Dict[Any, Any]:
        first: Dict[Any, yaml.Node] = {}
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue              # PyYAML's own error follows
            a, b = first.setdefault(key, key_node).start_mark, key_node.start_mark
            if a is not b:
                where = (f"line {a.line + 1} and line {b.line + 1}" if a.line != b.line else
                         f"line {a.line + 1}, columns {a.column + 1} and {b.column + 1}")
                raise ConfigError(f"key {key!r} is given twice in one mapping ({where}); the second "
                                  f"would replace the first: keep one")
        return super().construct_mapping(node, deep=deep)


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {' '.join(str(e).split())}") from None


def _read_file(path: str) -> Dict[str, Any]:
    """The mapping of keys in the YAML file at `path`."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    with open(path) as f:
        raw = _parse_yaml(f.read(), f"config file {path!r}") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of keys, not {type(raw).__name__}")
    return raw


def config_layers(path: str, _seen: Sequence[str] = ()) -> List[Tuple[str, Dict[str, Any]]]:
    """(file, keys) of the file at `path` and of its bases, the furthest base first.

    A file's ``base: OTHER.yaml`` (a path relative to the file's folder) is read first and the
    file's own keys are applied on top of it, key by key: a section (``optim:``) changes only
    the keys it names; a value (``model_kwargs``, a list) replaces the base's. Bases may have
    bases; a cycle is an error.
    """
    raw = dict(_read_file(path))
    if BASE_KEY not in raw:
        return [(path, raw)]
    base = raw.pop(BASE_KEY)
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{BASE_KEY}={base!r} in config file {path!r} must be the path of another "
                          f"config file, relative to its folder (e.g. {BASE_KEY}: recipes/deit300.yaml)")
    base_path = os.path.normpath(os.path.join(os.path.dirname(path), base))
    chain = [*_seen, path]
    if any(os.path.realpath(base_path) == os.path.realpath(p) for p in chain):
        raise ConfigError(f"config file {path!r}: {BASE_KEY}={base!r} makes a cycle "
                          f"({' -> '.join(chain + [base_path])}); a base must not lead back to its file")
    if not os.path.isfile(base_path):
        raise ConfigError(f"{BASE_KEY}={base!r} in config file {path!r}: {base_path!r} does not exist "
                          f"(the path is relative to {os.path.dirname(path) or '.'!r})")
    return config_layers(base_path, chain) + [(path, raw)]


def load_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> Config:
    """The defaults, updated by the YAML file at `path` (after its ``base:`` files, see
    `config_layers`), then by `key=value` overrides."""
    cfg = Config()
    for file, raw in config_layers(path) if path else ():
        for key, value in raw.items():
            try:
                _apply(cfg, str(key), value)
            except ConfigError as e:
                raise ConfigError(f"config file {file!r}: {e}") from None
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. optim.lr=1e-3)")
        if key.strip() == BASE_KEY:
            raise ConfigError(f"{BASE_KEY} can only be set in a config file (use --config FILE; "
                              f"the file's {BASE_KEY}: names the file it builds on)")
        value = _parse_yaml(text, f"override {item!r}") if text.strip() else ""
        _apply(cfg, key.strip(), value)
    return cfg.validate()


def config_to_dict(cfg: Config) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str) -> None:
    """Writes the resolved config as YAML, atomically."""
    write_text(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))

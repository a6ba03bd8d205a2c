"""ImageNet-1k training and evaluation of timm/DCViT models under torchrun (see docs/training.md).

    python -m train_imagenet --config configs/quickstart.yaml [key=value ...]
    torchrun --nproc_per_node=8 -m train_imagenet --config configs/deit300_dcvit_small.yaml

Modules, in the order data flows: config -> data -> model -> engine (metrics) -> checkpoint,
logs; ``__main__`` wires them.
"""
